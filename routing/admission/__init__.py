"""Fleet-wide admission: a request's walk over its fallback plan (`plan`, `admit`), one
candidate's acquire (`acquire`) of slots leased in Redis (`slots`, with prefix-cache
`affinity`), the tiered queue (`waiting`), the 429s (`refusals`) and their Retry-After
(`estimate`), admission while Redis is away (`outage`), what this replica holds (`holdings`)
and the give-back of all of it (`handback`), and the keeper's rounds (`keeper`: wake-ups,
sweeps, the spool), and rate limits (`ratelimit`). Its Lua scripts are routing/store/lua/.
May import: routing.store, routing.ledger, tiers, and the shared modules of routing/.
"""
