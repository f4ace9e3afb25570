"""Running ASGI apps under uvicorn (uvloop + httptools), alone or several in one loop,
each on a socket already bound by gateway/edge/listen.py."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from types import FrameType

import uvicorn

from gateway.edge.protocol import GatewayProtocol
from gateway.edge.workers import FORCE_SIGNAL, in_worker, start_heartbeat

try:  # uvloop is not on every platform; httptools is
    import uvloop  # noqa: F401

    LOOP = "uvloop"
except ImportError:  # pragma: no cover
    LOOP = "asyncio"

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

log = logging.getLogger("gateway")

# The cyclic collector's thresholds once a server has started (CPython's are 700, 10, 10).
# A request leaves no reference cycle behind (measured: about 400 unreachable objects after
# 15,000 requests, all of them from the shutdown), so every collection on the hot path
# finds nothing; at the default a young collection ran every few requests and older ones
# walked the in-flight requests' objects again: 6-7 % of the gateway's CPU per request at
# c=32 (bench/README.md). The collector stays on for the rare cycle (an error's
# traceback). Measured: 2,000 allocations between young collections saves as much CPU as
# 10,000; under load RSS grew less with it (two 128 KiB steps in a 10-minute soak at c=32,
# where 10,000 made three, and the default one or none: bench/README.md). 700 with the
# freeze alone saves a third of the CPU.
GC_THRESHOLDS = (2_000, 20, 20)


def settle_gc() -> None:
    """What a started server holds for its life (config, schemas, modules, the app) moves
    out of the collector's sight (`gc.freeze`), and the thresholds rise to GC_THRESHOLDS."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class ServerConfig(uvicorn.Config):
    """uvicorn's config, with the stop's grace in seconds (uvicorn's own takes whole
    seconds, and reads 0 as for ever)."""

    def __init__(self, app: object, grace_s: float, **options: object) -> None:
        super().__init__(app, **options)  # type: ignore[arg-type]
        self.grace_s = grace_s


def server_config(app: object, grace_s: float = 30) -> ServerConfig:
    return ServerConfig(
        app,
        grace_s,
        loop=LOOP,
        http=GatewayProtocol,  # httptools, each answer in one write (gateway/edge/protocol.py)
        lifespan="on",
        access_log=False,  # the gateway's own access log, if asked for (gateway/edge/access.py)
        log_level="warning",
        log_config=None,  # uvicorn's lines go through the process's handler (text or JSON)
        server_header=False,
        # The gateway reads no client address or scheme from the scope: uvicorn's
        # X-Forwarded-* rewriting (a middleware on every request) has nothing to feed.
        proxy_headers=False,
    )


# The wait for the requests a stop cut short (each answers, records and releases in its own
# handlers), and after it, once the connections of those still writing to a caller that
# does not read were dropped (which ends their writes), the last wait.
CUT_WAIT_S = 5.0
DROPPED_WAIT_S = 1.0


class _ForcedStopServer(uvicorn.Server):
    """uvicorn's server, whose stop ends the gateway whole, however it ends.

    uvicorn stops accepting and lets the requests in flight finish for the grace; what it
    does after differs from what the gateway needs. At the grace's end it cancelled the
    requests and ran the lifespan shutdown at once, without waiting for them to answer,
    record and release; forced (a second signal) it returned without cancelling them or
    running the lifespan shutdown: `asyncio.run` then cancelled what was left, each lifespan
    logged a `CancelledError` traceback, and records handed back but not yet written were
    neither awaited nor spooled. Here both ends are one: the requests still running are
    cut short (told `shutting_down`, recorded, released) and waited for, a caller that
    does not read loses its connection, and the lifespan shutdown runs once."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle keep-alive connections close; busy ones at their end
        await asyncio.sleep(0.1)
        grace = self.config.grace_s if isinstance(self.config, ServerConfig) else None
        with suppress(TimeoutError):  # the grace is over
            await asyncio.wait_for(self._drained(), timeout=grace)
        await self._cut_short()
        await self.lifespan.shutdown()

    async def _drained(self) -> None:
        """uvicorn's wait for the connections and requests to end, which a second signal
        stops (`force_exit`); then the servers' own close, skipped when forced (from Python
        3.12.1 the stdlib's `wait_closed` waits for every connection to end)."""
        state = self.server_state
        # uvicorn's server state has no event for either (it polls alike).
        while (state.connections or state.tasks) and not self.force_exit:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        if not self.force_exit:
            for server in self.servers:
                await server.wait_closed()

    async def _cut_short(self) -> None:
        tasks = list(self.server_state.tasks)
        if not tasks:
            return
        why = "forced" if self.force_exit else "the grace is over"
        log.warning("stopping (%s): cutting %d requests short", why, len(tasks))
        for task in tasks:
            task.cancel(msg="stopping")
        _, left = await asyncio.wait(tasks, timeout=CUT_WAIT_S)
        if left:
            for connection in list(self.server_state.connections):
                cycle = getattr(connection, "cycle", None)
                if cycle is not None and not cycle.response_complete:  # a whole one flushes
                    connection.transport.abort()
            await asyncio.wait(left, timeout=DROPPED_WAIT_S)


class _DrainingServer(_ForcedStopServer):
    """uvicorn's server, telling the app first when a stop signal arrives."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_stop = on_stop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        second, self.should_exit = self.should_exit, True
        if not second and self._on_stop is not None:
            self._on_stop()
        if sig == FORCE_SIGNAL or (second and not in_worker()):
            # Alone, a second signal, whichever, forces (uvicorn forced on SIGINT only). A
            # worker of `serve --workers` may get each stop twice, in either order (a
            # terminal's Ctrl-C reaches the whole group, and the parent passes it on as
            # SIGTERM): only its parent forces it, with FORCE_SIGNAL (gateway/edge/workers.py).
            self.force_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        start_heartbeat()  # a worker of `serve --workers` tells its parent its loop runs
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            settle_gc()

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the stop signal after its graceful shutdown, so the process
        # would die of SIGTERM; a drained gateway exits 0 instead (Kubernetes reads it).
        # The handlers run as the loop's callbacks, one after the other: a plain signal
        # handler can run inside another's (at its first instruction).
        loop = asyncio.get_running_loop()
        taken = (*STOP_SIGNALS, FORCE_SIGNAL) if in_worker() else STOP_SIGNALS
        for sig in taken:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in taken:
                loop.remove_signal_handler(sig)


def serve(
    app: object,
    sock: socket.socket | Sequence[socket.socket],
    *,
    grace_s: float = 30,
    on_stop: Callable[[], None] | None = None,
) -> None:
    """Run one app on `sock` (from `listen`; or several sockets) until SIGINT/SIGTERM: then
    it stops accepting, lets requests in flight finish for up to `grace_s`, runs the lifespan
    shutdown and returns."""
    sockets = [sock] if isinstance(sock, socket.socket) else list(sock)
    _DrainingServer(server_config(app, grace_s), on_stop).run(sockets=sockets)


class StartupFailed(Exception):
    """An app's lifespan startup failed (uvicorn says so with sys.exit)."""


class _QuietServer(_ForcedStopServer):
    """A server that leaves signals to its owner, so several can share one loop."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().serve(sockets)
        except SystemExit as exc:
            # Out of a task, SystemExit would escape the event loop and strand the other
            # servers; as an exception their owner stops them.
            raise StartupFailed(f"startup failed (exit code {exc.code})") from None


class _Stops:
    """The signals' handler of `serve_together`: the first stops the front, any later one
    forces every stop."""

    def __init__(self, servers: list[_QuietServer], tasks: list[asyncio.Task[None]]) -> None:
        self.servers, self.tasks = servers, tasks
        self.forced = False

    def __call__(self) -> None:
        front = self.servers[-1]
        if not front.should_exit:
            front.should_exit = True
            return
        self.forced = True
        for server, task in zip(self.servers, self.tasks, strict=True):
            server.force_exit = server.should_exit  # those not stopping yet keep serving
            if not server.started:
                task.cancel()  # a startup that does not end


async def serve_together(
    apps: Sequence[tuple[uvicorn.Config, socket.socket]],
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Run several servers in this loop until SIGINT or SIGTERM, or until one of them
    ends or fails (then all stop; a failure is raised). On a signal the last of `apps`, the
    front whose requests use the others, stops first and the rest once it has ended (else
    the demo's workers broke the gateway's streams under it); a second signal forces every
    stop (the front cuts its requests short, telling their callers so)."""
    servers = [_QuietServer(config) for config, _ in apps]
    loop = asyncio.get_running_loop()
    tasks = [
        loop.create_task(server.serve([sock]))
        for server, (_, sock) in zip(servers, apps, strict=True)
    ]
    stop = _Stops(servers, tasks)
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop)
    try:
        started = await _all_started(servers, tasks)
        if on_ready is not None and started and not any(s.should_exit for s in servers):
            on_ready()
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for server in servers:
            server.should_exit = True
            server.force_exit = server.force_exit or stop.forced
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise failed[0]


async def _all_started(
    servers: Sequence[_QuietServer], tasks: Sequence[asyncio.Task[None]]
) -> bool:
    """Until every server has started (True) or one of them ended first (False)."""
    while not all(s.started for s in servers):
        if any(t.done() for t in tasks):
            return False
        await asyncio.sleep(0.05)  # uvicorn has no started event to wait on
    return True
