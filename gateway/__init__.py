"""The gateway process: HTTP in, routing/ and tiers/ below, answers out.

Rooms, each a package whose own docstring says what it holds: `edge` (the HTTP server and ASGI
plumbing, nothing about LLMs), `runtime` (config, keys, live reload and the state a running gateway
holds), `completions` (the product path of the two POST routes), `schemas` (their request bodies),
`app` (the ASGI app: hot routes and operator routes), `cli` (the commands, the demo, the usage
export) and `sim` (a simulated GPU worker). The modules at this level are shared by every room:
`errors` (the one exception tree, where status codes are decided) and `metrics` (every Prometheus
family); they may import routing/ and tiers/ only; `ratelimits` writes a rate-limited key's
headers. Which room may import which is one table, tests/test_layers.py.
"""
