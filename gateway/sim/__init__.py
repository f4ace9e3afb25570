"""`gateway sim`: a simulated vLLM-like GPU worker for demos, tests and benchmarks.

A product feature beside the request path, not part of it: `worker` is the ASGI app (timing,
HTTP and the `/sim/*` test seams), `text` what it says, `load` its generation slots and peaks,
`wire` its ASGI plumbing. May import: gateway.edge (the server protocol and the plain-ASGI
reply), nothing of the gateway's product.
"""

from gateway.sim.worker import SimOptions, build_sim_app

__all__ = ["SimOptions", "build_sim_app"]
