-- The prelude's first part: what every model script shares before its own code. The
-- prelude (routing/store/scripts.py `PRELUDE`) is these files in order, one Lua chunk:
-- prelude_names (constants, the per-call state, `bind`), prelude_seats (the endpoint
-- choice and the functions a script's common case calls: each `-- @fn` block, made before
-- the script's code only where its `-- @needs` line names it), then, at the script's
-- `-- @rest` line (or before the script when it has none), all the others: prelude_queue
-- (an id's parts, the queue's places and counts, finding a lease), prelude_fair (fair
-- share's counts and queues), prelude_liveness (reclaiming what dead replicas held),
-- prelude_pump (handing slots on, the rebuild window, preemption) and prelude_spec (the
-- model's spec from its packed argument). Lua makes each local function anew on every
-- call (about 150 ns with its upvalues), so the common case makes only those it calls.
-- A function sees only what the files before it, and the lines before it, define.
-- The keys: routing/store/keys.py (KEYS[1] is the model's `leases`, the others are named
-- after it: the same hash tag {model}, one Cluster slot). A key passed in KEYS costs a
-- script about 230 ns, a name made here about 100 ns. What each script costs, in O() of
-- the endpoints (n), queue (w) and waiting accounts (a): docs/architecture.md.
-- The state marker's value when no rebuild window can be open: the common case's test.
local STEADY = '0'
-- A tier's ceiling at the sum of the endpoints' sizes, which `seat` holds each endpoint to:
-- not checked (routing/slots.py `UNBOUND`).
local UNBOUND = '-'
local RANK = 1e15
-- A member of `free` that is no endpoint, always there (scored +inf: last, after every
-- endpoint with room), and a field of `ep_load` and `eps` likewise: longer than the 64
-- bytes Redis keeps in a flat list (a listpack, searched from end to end: by default up to
-- 128 entries), so those keys are a skip list and hash tables whatever the number of
-- endpoints, and `free` never goes when the model is full. On 64 endpoints the flat lists
-- cost an admission 35-38 us of Redis CPU where 1 or 1,000 endpoints cost 21-25
-- (bench/fleet.py). Written with the index (index.lua) and by the sweeps; `wide`. In `eps` it
-- reads as an endpoint of size 0 ('0 0'): a replica of a release before it, which takes
-- `free`'s head for an endpoint, finds it full there, drops it from `free` (the next sweep
-- puts it back) and takes none (an entry it could not read failed its script midway, a
-- lease on it written, whose reclaim failed every script of this release that ran it).
-- (A literal: a library's load may not call `string`.)
local WIDE = '~----------------------------------------------------------------'
-- RANKS: how many tiers (tiers/policy.py, for callers without the spec) and WAIT_FIELDS
-- their waiters' counts in `ep_load` (`~w<rank>`), written here from the tier table.
-- @tiers
-- Everything below is per call, set by `bind` before a script's own code runs: the keys'
-- names, and what a call reads once (a call runs at one instant). The scripts run as one
-- library of Redis Functions where Redis has them (loaded once: routing/store/scripts.py),
-- else each as a script that binds its own KEYS first.
-- The model's key names: LEASES (KEYS[1]), BASE (their tag) and one per key of
-- routing/store/keys.py `MODEL` (written here from that table), and ACCOUNT_PREFIX.
-- @key-names
local ACCOUNT, ENTRIES
-- `full`: `free` was found empty and nothing was added since (`take_any`, `rescore`): a later
-- choice in the same call answers without a call (a full model's acquire picks twice).
-- `clock`: Redis's TIME. `waits`: the waiters per tier (prelude's rest: `waiting_counts`).
-- `leases_n`: the model's leases (`inflight`). `touched`: `rescore`'s tie-break.
-- `rebuild_open`: whether a rebuild window is open (`rebuilding`). `ranks`: how many tiers,
-- RANKS or as many as the caller's spec names (`parse_spec`). `modes`: each tier's fair
-- share by the spec ('a' accounts' requests, 't' their tokens, false first come first
-- served; nil: not known, requests). `roles`: each tier's part in preemption by the spec
-- ('p' may preempt, 'v' may be preempted, '-' neither; nil: not known, none).
-- `counted`: whether fair share's counts are kept now (the low bit of `~f`, `counting`).
-- `roomy`: `free` is known to hold an endpoint (`has_room`), `free_head`: which is first
-- (`take_any`); both forgotten at each write to `free` (`rescore`, `take_slot`).
local full, clock, waits, leases_n, touched, rebuild_open, ranks, modes, roles, counted
local roomy, free_head
-- `ep_urls`: the endpoints `ep_load` counts, read once per call where a lease is looked for
-- on every endpoint (`endpoint_urls`).
local ep_urls

-- The names are made again only when the model changes: a library of Redis Functions keeps
-- them between calls (about 0.8 usec a call), a script makes them on every call.
local function bind(keys)
  if keys[1] ~= LEASES then
    LEASES = keys[1]
    BASE = string.sub(LEASES, 1, -7)
    -- @keys
  end
  -- On one Redis, acquire and release may be given an account's key after the model's
  -- leases (on a Cluster they are given every key of the model, routing/admission/slots.py
  -- `declare_all`, and never an account's: it lives on another node).
  ACCOUNT = keys[#keys == 2 and 2 or 0]
  -- One Redis (given the leases alone, or an account's key too): every key is on this node,
  -- so a dead replica's lease or waiter that leaves takes its account's entry (`drop_entry`).
  ENTRIES = #keys <= 2
  full, clock, waits, leases_n, touched, rebuild_open, ranks = false, nil, nil, nil, nil, nil, RANKS
  modes, roles, counted = nil, nil, nil
  roomy, free_head, ep_urls = nil, nil, nil
end
