"""The store: Redis as admission and the ledger use it, and nothing about what they keep there.

The lean pipelining RESP client (`resp`, on `wire`), the `Store` interface (`base`) that it,
the Cluster client (`cluster`, with `slotmap`) and redis-py's (`connect`) carry, Sentinel
(`sentinel`), what a store error means (`causes`), the probe behind /readyz (`probe`), and the
Lua scripts (`lua/`) with their registry (`scripts`: EVALSHA in batches, NOSCRIPT reloads).
The scripts live here and not in admission because the ledger runs one too (`usage.lua`).
May import: redis-py and hiredis; nothing else of ours.
"""
