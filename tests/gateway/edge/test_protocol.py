"""gateway/edge/protocol.py: a response head leaves with its body, in one write, in order."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.edge import protocol
from gateway.edge.protocol import (
    GatewayProtocol,
    HeadJoiningTransport,
    forget_disconnect,
    on_disconnect,
    write_answer,
    write_stream_start,
)

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"


class _Recorder:
    """A transport that records what it is asked to do."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.calls: list[str] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.calls.append("close")
        self.closing = True

    def abort(self) -> None:
        self.calls.append("abort")
        self.closing = True

    def write_eof(self) -> None:
        self.calls.append("write_eof")

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


def _joining() -> tuple[HeadJoiningTransport, _Recorder]:
    inner = _Recorder()
    return HeadJoiningTransport(inner, asyncio.get_running_loop()), inner  # type: ignore[arg-type]


async def test_a_head_and_its_body_leave_in_one_write() -> None:
    joined, inner = _joining()
    joined.write(HEAD)
    assert inner.writes == []
    assert joined.get_write_buffer_size() == len(HEAD)
    joined.write(b"{}")
    assert inner.writes == [HEAD + b"{}"]
    joined.write(b"more")  # not a head: straight through
    assert inner.writes == [HEAD + b"{}", b"more"]


async def test_a_head_nothing_follows_leaves_on_the_next_loop_turn() -> None:
    joined, inner = _joining()
    joined.write(HEAD)
    await asyncio.sleep(0)
    assert inner.writes == [HEAD]
    joined.write(b"{}")
    assert inner.writes == [HEAD, b"{}"]


async def test_an_interim_100_continue_is_never_held() -> None:
    joined, inner = _joining()
    joined.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert inner.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]


async def test_close_and_eof_send_a_held_head_first_abort_drops_it() -> None:
    joined, inner = _joining()
    joined.write(HEAD)
    joined.close()
    assert inner.writes == [HEAD] and inner.calls == ["close"]
    joined, inner = _joining()
    joined.write(HEAD)
    joined.write_eof()
    assert inner.writes == [HEAD] and inner.calls == ["write_eof"]
    joined, inner = _joining()
    joined.write(HEAD)
    joined.abort()
    await asyncio.sleep(0)
    assert inner.writes == [] and inner.calls == ["abort"]


async def test_the_rest_of_the_transport_is_the_inner_ones() -> None:
    joined, _ = _joining()
    assert joined.get_extra_info("peername") == ("127.0.0.1", 1)
    assert joined.get_extra_info("nothing", 7) == 7
    assert not joined.is_closing()


class _App:
    """Answers `/answer` at once; on `/hold` registers a disconnect callback and waits."""

    def __init__(self) -> None:
        self.registered = asyncio.Event()
        self.lost = asyncio.Event()
        self.told: bool | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/answer":
            head = [(b"content-type", b"application/json"), (b"content-length", b"2")]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        self.told = on_disconnect(receive, self.lost.set)
        self.registered.set()
        try:
            await asyncio.wait_for(self.lost.wait(), 10)
        finally:
            forget_disconnect(receive)


async def _serving(app: _App) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # As the gateway runs it: no uvicorn access log (with one, `write_answer` declines).
    config = uvicorn.Config(
        app, http=GatewayProtocol, lifespan="off", log_config=None, access_log=False
    )
    server = uvicorn.Server(config)
    sock.listen(16)  # connections wait in the backlog until the server accepts them
    task = asyncio.get_running_loop().create_task(server.serve([sock]))
    return server, task, sock.getsockname()[1]


async def test_an_answer_is_whole_and_a_lost_caller_calls_back_without_a_task() -> None:
    app = _App()
    server, task, port = await _serving(app)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /answer HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 ") and b"content-length: 2" in head
        assert await asyncio.wait_for(reader.readexactly(2), 5) == b"{}"
        writer.write(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(app.registered.wait(), 5)
        assert app.told is True
        writer.close()
        await asyncio.wait_for(app.lost.wait(), 5)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def test_on_another_server_nothing_is_registered() -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    assert on_disconnect(receive, lambda: None) is False
    forget_disconnect(receive)  # harmless


class _Counted:
    """An app recording what the write it tries answered, and each socket write."""

    def __init__(self) -> None:
        self.results: list[bool] = []
        self.writes: list[bytes] = []

    async def _request(self, scope: Any, receive: Any, send: Any) -> bool:
        """Whether this is a request (read, its writes counted from now on)."""
        if scope["type"] != "http":
            return False
        await receive()
        _count_writes(send, self.writes)
        return True


class _WholeApp(_Counted):
    """Answers every request with `write_answer`, counting the socket writes it makes."""

    def __init__(self, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__()
        self.headers = headers or [(b"content-type", b"application/json"), (b"x-request-id", b"r1")]
        self.errors: list[Exception] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if not await self._request(scope, receive, send):
            return
        try:
            self.results.append(await write_answer(send, 200, self.headers, b'{"a":1}'))
        except RuntimeError as exc:
            self.errors.append(exc)
            await send({"type": "http.response.start", "status": 500, "headers": []})
            await send({"type": "http.response.body", "body": b""})


class _Counting:
    """A transport passing everything on, recording each write."""

    def __init__(self, inner: Any, writes: list[bytes]) -> None:
        self._inner = inner
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(data)
        self._inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _count_writes(send: Any, writes: list[bytes]) -> None:
    """Every socket write of the connection whose request's `send` this is, into `writes`."""
    transport = send.__self__.transport
    if not isinstance(transport._transport, _Counting):
        transport._transport = _Counting(transport._transport, writes)


async def _exchange(port: int, request: bytes, answers: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    got = b""
    try:
        for _ in range(answers):
            got += await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            got += await asyncio.wait_for(reader.readexactly(7), 5)
        return got + await asyncio.wait_for(reader.read(), 5)  # b"" once the server closes
    finally:
        writer.close()


async def _head_of(port: int) -> bytes:
    """The head of the answer to one request on a connection of its own."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    finally:
        writer.close()


async def test_a_whole_answer_is_one_write_and_keeps_the_connection() -> None:
    app = _WholeApp()
    server, task, port = await _serving(app)  # type: ignore[arg-type]
    try:
        # Two requests pipelined, then one asking to close: three answers, in order.
        request = b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
        last = b"POST /x HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
        got = await _exchange(port, request * 2 + last, 3)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
    answers = got.split(b"HTTP/1.1 ")[1:]
    assert len(answers) == 3 and app.results == [True, True, True]
    assert len(app.writes) == 3  # one write each: head and body together
    for answer, write in zip(answers, app.writes, strict=True):
        assert b"HTTP/1.1 " + answer == write
        head, body = write.split(b"\r\n\r\n")
        assert body == b'{"a":1}' and b"content-length: 7" in head
        assert b"x-request-id: r1" in head and b"date: " in head  # uvicorn's default headers
    assert b"connection: close" not in answers[0] and b"connection: close" in answers[2]


async def test_a_whole_answer_to_http_1_0_closes_the_connection() -> None:
    app = _WholeApp()
    server, task, port = await _serving(app)  # type: ignore[arg-type]
    try:
        got = await _exchange(port, b"POST /x HTTP/1.0\r\ncontent-length: 0\r\n\r\n", 1)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
    assert got.startswith(b"HTTP/1.1 200 ") and b"connection: close\r\n" in got
    assert got.endswith(b'{"a":1}') and app.results == [True]


async def test_a_header_value_that_would_split_the_answer_is_refused() -> None:
    app = _WholeApp([(b"x-request-id", b"r1\r\nset-cookie: a=b")])
    server, task, port = await _serving(app)  # type: ignore[arg-type]
    try:
        head = await _head_of(port)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
    assert head.startswith(b"HTTP/1.1 500 ") and b"set-cookie" not in head
    assert len(app.errors) == 1 and app.results == []


@pytest.mark.parametrize("name", [b"x request", b"x-a:b", b"x-(a)", b"x-a\r\nset-cookie"])
async def test_a_bad_header_name_is_refused_after_good_names_were_seen(name: bytes) -> None:
    """Valid names are remembered (a bounded set); a bad one is checked every time."""
    app = _WholeApp([(b"content-type", b"application/json"), (name, b"v")])
    server, task, port = await _serving(app)  # type: ignore[arg-type]
    try:
        app.headers = _WholeApp().headers  # first a good answer, whose names are kept
        close = b"POST /x HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
        assert (await _exchange(port, close, 1)).startswith(b"HTTP/1.1 200 ")
        app.headers = [(b"content-type", b"application/json"), (name, b"v")]
        head = await _head_of(port)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
    assert head.startswith(b"HTTP/1.1 500 ") and name not in head
    assert len(app.errors) == 1
    assert name not in protocol._GOOD_NAMES and b"content-type" in protocol._GOOD_NAMES
    assert len(protocol._GOOD_NAMES) <= protocol._MAX_GOOD_NAMES


async def test_write_answer_declines_what_it_cannot_send_whole() -> None:
    sent: list[Any] = []

    async def plain_send(message: Any) -> None:  # another server's send
        sent.append(message)

    assert await write_answer(plain_send, 200, [], b"{}") is False
    assert sent == []


@pytest.mark.slow
async def test_an_idle_connection_closes_a_keep_alive_timeout_after_its_last_answer() -> None:
    """One timer per idle spell (gateway/edge/protocol.py): a request inside the timeout keeps
    the connection, and the close comes a whole timeout after the last answer."""
    app = _WholeApp()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, http=GatewayProtocol, lifespan="off", log_config=None, access_log=False,
        timeout_keep_alive=1,
    )  # fmt: skip
    server = uvicorn.Server(config)
    sock.listen(16)
    task = asyncio.get_running_loop().create_task(server.serve([sock]))
    request = b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
    loop = asyncio.get_running_loop()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        for _ in range(3):  # each inside the timeout of the one before
            writer.write(request)
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            await asyncio.wait_for(reader.readexactly(7), 5)
            last = loop.time()
            await asyncio.sleep(0.6)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        idle = loop.time() - last
        writer.close()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
    assert app.results == [True, True, True]
    assert idle >= 0.9  # not before the timeout after the last answer


class _StreamApp(_Counted):
    """Streams `first` (through `write_stream_start`) then two more parts (through `send`),
    recording each socket write."""

    def __init__(self, first: bytes) -> None:
        super().__init__()
        self.first = first

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if not await self._request(scope, receive, send):
            return
        head = [(b"content-type", b"text/event-stream"), (b"x-request-id", b"r1")]
        self.results.append(await write_stream_start(send, 200, head, self.first))
        for part in (b"data: 2\n\n", b"data: [DONE]\n\n"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.mark.parametrize("first", [b"data: 1\n\n", b""])
async def test_a_stream_starts_with_its_head_and_first_part_in_one_write(first: bytes) -> None:
    """Chunked as uvicorn frames it, the connection kept: a client reads two streams on it.
    An empty first part sends the head alone, held and joined to the next part."""
    app = _StreamApp(first)
    server, task, port = await _serving(app)  # type: ignore[arg-type]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            answers = [await client.post("/x", content=b"") for _ in range(2)]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
    assert app.results == [True, True]
    for answer in answers:
        assert answer.status_code == 200 and answer.headers["x-request-id"] == "r1"
        assert answer.headers["transfer-encoding"] == "chunked"
        assert answer.text == first.decode() + "data: 2\n\ndata: [DONE]\n\n"
    opening = app.writes[0]
    assert opening.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked\r\n\r\n" in opening
    part = first or b"data: 2\n\n"  # the head waited for the next write
    assert opening.endswith(b"\r\n\r\n%x\r\n%s\r\n" % (len(part), part))
    # Per stream: the opening, each later part, the end.
    assert len(app.writes) == 2 * (4 if first else 3)


async def test_write_stream_start_declines_on_another_server() -> None:
    sent: list[Any] = []

    async def plain_send(message: Any) -> None:
        sent.append(message)

    assert await write_stream_start(plain_send, 200, [], b"data: 1\n\n") is False
    assert sent == []
