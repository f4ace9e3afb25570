"""Many simulated workers in one process (`gateway sim --endpoints N`): one worker per port,
each with its own slots, counters and `/sim/*` seams, as N GPU servers would be.

One server listens on every port and each request goes to the worker of the port it
arrived on (the ASGI scope's `server`): N workers cost one event loop, not N servers with a
timer each, so a fleet bench can stand up 1,000 endpoints on a laptop's loopback.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.sim.wire import lifespan
from gateway.sim.worker import SimOptions, build_sim_app

# The most workers one process hosts (ports are a contiguous range from --port).
MAX_ENDPOINTS = 4096


class SimFleet:
    """The workers of `ports`, each answering on its own port."""

    def __init__(self, options: SimOptions, ports: Sequence[int]) -> None:
        if not 1 <= len(ports) <= MAX_ENDPOINTS:
            raise ValueError(f"from 1 to {MAX_ENDPOINTS} endpoints, not {len(ports)}")
        self.workers: dict[int, ASGIApp] = {port: build_sim_app(options) for port in ports}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        server = scope.get("server") or ("", 0)
        worker = self.workers.get(int(server[1] or 0))
        if worker is None:  # a port not ours (a proxy in front): the first worker answers
            worker = next(iter(self.workers.values()))
        await worker(scope, receive, send)
