"""How an endpoint is chosen: one seam, in the shape of a scheduler's filter, scorers and
picker.

- **Filter**: the endpoints in rotation (healthy, configured: routing/hop/health.py), with
  room for the request's tier (its ceiling) and its tokens (prelude_seats.lua `fits`: the
  script alone knows what each endpoint has reserved).
- **Scorers**, one per file, each turning what a replica knows into what the choice reads:
  - `penalty`: a worker's own load signal (its queue, its KV cache), a number >= 0 added
    to the endpoint's score; written into the endpoint index (routing/store/lua/index.lua).
  - `load`: an endpoint's load relative to its size (or its tokens relative to its budget,
    the larger), plus its penalty: the score `free` ranks endpoints by.
  - `affinity`: the few endpoints a prompt-cache key prefers, in order (a consistent-hash
    ring): passed to the acquire, which takes the first of them with room.
  - the partition a request goes to: routing/admission/partitions.py (a model's endpoints
    dealt over partitions, each its own slots in Redis).
- **Picker**: with Redis, the acquire script (prelude_seats.lua `seat`: the first
  preferred endpoint with room, else `take_any`: the head of `free`, the lowest `load`
  score), so every replica picks from the same counts. While Redis is away
  (`on_outage: local`), `pick.least_loaded` over this replica's own counts, with the same
  scorers.

A new signal is a scorer here, fed to the index (as the penalty is) or to the acquire's
arguments (as affinity is), and read by both pickers (docs/how-to.md).
"""
