"""Running ASGI apps under uvicorn (uvloop + httptools), alone or several in one loop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

import uvicorn

try:  # uvloop is not on every platform; httptools is
    import uvloop  # noqa: F401

    LOOP = "uvloop"
except ImportError:  # pragma: no cover
    LOOP = "asyncio"


def server_config(app: object, host: str, port: int, grace_s: float = 30) -> uvicorn.Config:
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        loop=LOOP,
        http="httptools",
        lifespan="on",
        access_log=False,  # no per-request logging on the hot path (and no prompts in logs)
        log_level="warning",
        server_header=False,
        timeout_graceful_shutdown=int(grace_s) or None,
    )


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app first when a stop signal arrives."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_stop = on_stop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._on_stop is not None:
            self._on_stop()
        super().handle_exit(sig, frame)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the stop signal after its graceful shutdown, so the process
        # would die of SIGTERM; a drained gateway exits 0 instead (Kubernetes reads it).
        stops = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in stops}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(
    app: object,
    host: str,
    port: int,
    *,
    grace_s: float = 30,
    on_stop: Callable[[], None] | None = None,
) -> None:
    """Run one app until SIGINT/SIGTERM: then it stops accepting, lets requests in flight
    finish for up to `grace_s`, runs the lifespan shutdown and returns."""
    _DrainingServer(server_config(app, host, port, grace_s), on_stop).run()


class _QuietServer(uvicorn.Server):
    """A server that leaves signals to its owner, so several can share one loop."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_together(
    configs: Sequence[uvicorn.Config], on_ready: Callable[[], None] | None = None
) -> None:
    """Run several servers in this loop; SIGINT or SIGTERM stops them all."""
    servers = [_QuietServer(c) for c in configs]
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for s in servers:
            s.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    tasks = [loop.create_task(s.serve()) for s in servers]
    try:
        while not all(s.started for s in servers):
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.05)
        if on_ready is not None and all(s.started for s in servers):
            on_ready()
        await asyncio.gather(*tasks)
    finally:
        stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
