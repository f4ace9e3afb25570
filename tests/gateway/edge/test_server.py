"""gateway/edge/server.py: how a stop ends, on a real uvicorn server in this loop. Whether the
grace runs out or a second signal forces it, the requests still running are cut short and
waited for (a caller that does not read loses its connection, which ends the write it
blocks), and only then does the lifespan shutdown run, once."""

from __future__ import annotations

import asyncio
import signal
import socket
from typing import Any

import pytest

from gateway.edge import server as server_module
from gateway.edge.server import _DrainingServer, _QuietServer, server_config
from gateway.edge.workers import FORCE_SIGNAL


class _App:
    """A lifespan that counts, and requests that run until cancelled; cut short, a request
    answers (`/quiet`) or keeps writing to its caller (`/flood`), as the gateway's own cut
    does; what happened is in `events`, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.ready = asyncio.Event()  # the lifespan started
        self.running = asyncio.Event()  # a request is in flight

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
                self.ready.set()
            self.events.append("lifespan shutdown")
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        head = [(b"content-type", b"text/plain")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        try:
            self.running.set()
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            self.events.append("cut")
            part = b"x" * (1 << 20) if scope["path"] == "/flood" else b"cut"
            for _ in range(64 if scope["path"] == "/flood" else 1):  # 64 MiB: more than TCP holds
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            self.events.append("answered")


async def _serve(app: _App, grace_s: float) -> tuple[_QuietServer, asyncio.Task[None], int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = _QuietServer(server_config(app, grace_s))
    task = asyncio.get_running_loop().create_task(server.serve([sock]))
    await asyncio.wait_for(app.ready.wait(), 5)  # connections wait in the backlog till served
    return server, task, sock.getsockname()[1]


async def _request(port: int, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path.encode())
    return reader, writer


async def test_a_grace_under_a_second_ends_and_the_cut_request_answers_first() -> None:
    """uvicorn's own grace took whole seconds and read 0 as for ever: 0.3 s waited for ever."""
    app = _App()
    server, task, port = await _serve(app, grace_s=0.3)
    reader, writer = await _request(port, "/quiet")
    try:
        await asyncio.wait_for(app.running.wait(), 5)
        server.should_exit = True
        await asyncio.wait_for(task, 5)
        answer = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    assert answer.endswith(b"3\r\ncut\r\n0\r\n\r\n")
    assert app.events == ["cut", "answered", "lifespan shutdown"]


async def test_a_forced_stop_drops_a_caller_that_does_not_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cut request blocks writing to a caller that reads nothing: after the wait its
    connection is dropped, the write ends, and the lifespan shutdown still comes after."""
    monkeypatch.setattr(server_module, "CUT_WAIT_S", 0.3)
    app = _App()
    server, task, port = await _serve(app, grace_s=3600)
    _, writer = await _request(port, "/flood")  # never read
    try:
        await asyncio.wait_for(app.running.wait(), 5)
        server.should_exit = True
        await asyncio.sleep(0.2)  # draining: the grace would last an hour
        assert not task.done()
        server.force_exit = True  # what a second signal sets
        await asyncio.wait_for(task, 5)
    finally:
        writer.close()
    assert app.events == ["cut", "answered", "lifespan shutdown"]


def test_a_second_signal_of_either_kind_forces_the_stop() -> None:
    """uvicorn forced only on a second SIGINT: a second SIGTERM drained on for the grace."""
    stops: list[str] = []
    for first, second in [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM)]:
        server = _DrainingServer(server_config(_App()), lambda: stops.append("stop"))
        server.handle_exit(first, None)
        assert server.should_exit and not server.force_exit
        server.handle_exit(second, None)
        assert server.force_exit
    assert stops == ["stop", "stop"]  # the app is told once per server, at the first signal


def test_a_worker_is_forced_by_its_parent_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker of `serve --workers` gets a Ctrl-C's SIGINT and its parent's SIGTERM, in
    either order (measured here: the SIGTERM first about 1 time in 25), and a service
    manager's SIGTERM with its parent's: one drain, however many. Its parent forces it."""
    monkeypatch.setattr(server_module, "in_worker", lambda: True)
    stops: list[str] = []
    server = _DrainingServer(server_config(_App()), lambda: stops.append("stop"))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGINT, signal.SIGTERM):
        server.handle_exit(sig, None)
    assert server.should_exit and not server.force_exit and stops == ["stop"]
    server.handle_exit(FORCE_SIGNAL, None)
    assert server.force_exit
