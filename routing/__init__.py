"""Everything between the edge and the GPU workers, HTTP-free: which model and endpoint a
request gets, what it holds in Redis meanwhile, and the hop to the worker.

Four rooms, each a package whose own docstring says what it holds: `store` (Redis: the clients, the
Lua scripts and their registry), `ledger` (usage records and their spool), `admission` (the walk,
slots, queues, leases and what gives them back), `hop` (the HTTP/1.1 client to workers, endpoints
and health). The modules at this level are shared by the rooms: `errors` (routing's errors as data,
the only contract with the edge, with `quotas`: rate limits' state for the edge's headers),
`registry` (the fleet as configured) and `background` (rounds that never stop); they may import the
store and tiers/ only. Nothing here imports `gateway`; which room may import which is one table,
tests/test_layers.py.
"""
