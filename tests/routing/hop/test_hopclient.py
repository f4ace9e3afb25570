"""The hop's error translation (routing/hop/client.py): the same `Worker*` error and message
for each failure as the aiohttp `Upstream` gave (before the hop client replaced it), against
raw sockets on 127.0.0.1 playing misbehaving workers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest

from routing.errors import WorkerBrokeOff, WorkerFailed, WorkerTimeout, WorkerUnreachable
from routing.hop.client import HopClient, HopResponse
from routing.hop.http1 import Disconnected, NotHttp, Silent
from routing.hop.upstream import UpstreamSettings

BOUND_S = 10.0
# Short, so that a stalled worker times out at once; nothing asserts how long it took.
READ_TIMEOUT_S = 0.1
HEADERS = {"content-type": "application/json"}
BODY = b'{"ok": true}'
T = TypeVar("T")

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def bounded(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, BOUND_S)


@contextlib.asynccontextmanager
async def worker(handler: Handler, *, read_head: bool = True) -> AsyncIterator[str]:
    """A raw worker on 127.0.0.1 running `handler` per connection (after reading the
    request's head, with `read_head`); yields its base URL."""
    serving: set[asyncio.Task[Any]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if (task := asyncio.current_task()) is not None:
            serving.add(task)
        try:
            if read_head:  # the body is ignored
                await reader.readuntil(b"\r\n\r\n")
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for task in serving:  # a stalled handler too
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)
        await server.wait_closed()


@contextlib.asynccontextmanager
async def hop(**settings: Any) -> AsyncIterator[HopClient]:
    options = {"read_timeout_s": READ_TIMEOUT_S, **settings}
    client = HopClient(UpstreamSettings(**options), max_connections=4)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


def head(length: int) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
        length
    )


def streamed(first: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(first), first)
    )


async def post(client: HopClient, url: str) -> HopResponse:
    return await bounded(client.post(url + "/v1/chat/completions", b"{}", HEADERS))


def free_port() -> int:
    """A port nothing listens on (bound, then closed: a connect is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def silent_after(first: bytes) -> AsyncIterator[str]:
    """A worker that sends `first` and then nothing, keeping the connection open."""
    release = asyncio.Event()

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(first)
        await writer.drain()
        await release.wait()

    try:
        async with worker(silent) as url:
            yield url
    finally:
        release.set()


async def collect(resp: HopResponse) -> list[bytes]:
    return [chunk async for chunk in resp.chunks()]


# --- before the answer's headers (HopClient.post) -----------------------------------------------


async def test_a_refused_connection_is_unreachable() -> None:
    async with hop() as client:
        with pytest.raises(WorkerUnreachable) as caught:
            await post(client, f"http://127.0.0.1:{free_port()}")
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)
    assert caught.value.message == "The worker could not be reached."


async def test_a_connection_closed_before_any_answer_is_unreachable() -> None:
    async def hang_up(_reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        return  # closes without a byte

    async with worker(hang_up) as url, hop() as client:
        with pytest.raises(WorkerUnreachable) as caught:
            await post(client, url)
    assert isinstance(caught.value.__cause__, Disconnected)
    assert caught.value.message == "The worker could not be reached."


async def test_a_tls_handshake_that_fails_is_unreachable() -> None:
    """https:// to a worker that speaks plain HTTP: the handshake fails (an SSL error)."""

    async def plain(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    async with worker(plain, read_head=False) as url, hop() as client:
        with pytest.raises(WorkerUnreachable) as caught:
            await bounded(client.post(url.replace("http:", "https:") + "/v1", b"{}", HEADERS))
    assert isinstance(caught.value.__cause__, OSError)


async def test_a_connect_that_does_not_finish_in_time_is_unreachable() -> None:
    """A listener whose backlog is full never completes the handshake of one more client."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        try:
            for _ in range(8):  # more than the backlog holds: the next SYN is dropped
                filler = socket.socket()
                filler.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    filler.connect(("127.0.0.1", port))
                fillers.append(filler)
            async with hop(connect_timeout_s=0.2) as client:
                with pytest.raises(WorkerUnreachable) as caught:
                    await post(client, f"http://127.0.0.1:{port}")
        finally:
            for filler in fillers:
                filler.close()
    assert caught.value.message in (
        "The worker could not be reached in time.",
        "The worker could not be reached.",  # a kernel that refuses instead of dropping
    )


async def test_a_worker_silent_before_its_headers_times_out() -> None:
    async with silent_after(b"") as url, hop() as client:
        with pytest.raises(WorkerTimeout) as caught:
            await post(client, url)
    assert isinstance(caught.value.__cause__, Silent)
    assert caught.value.message == "The worker did not answer in time."


async def test_an_answer_that_is_not_http_is_a_worker_failure() -> None:
    async def garbage(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SPEAKING SOMETHING ELSE\r\n\r\n")
        await writer.drain()

    async with worker(garbage) as url, hop() as client:
        with pytest.raises(WorkerFailed) as caught:
            await post(client, url)
    assert type(caught.value) is WorkerFailed
    assert isinstance(caught.value.__cause__, NotHttp)
    assert caught.value.message == "The worker answered garbage."


@pytest.mark.parametrize("many", [False, True], ids=["one-endless-header", "many-headers"])
async def test_an_answer_head_past_the_bound_is_a_worker_failure(many: bool) -> None:
    async def endless(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nx-a: ")
        for i in range(200):  # 200 x 1 KiB, the client stops reading long before
            writer.write(b"x-%d: %s\r\n" % (i, b"y" * 1000) if many else b"y" * 1024)
            await writer.drain()

    async with worker(endless) as url, hop() as client:
        with pytest.raises(WorkerFailed) as caught:
            await post(client, url)
    assert type(caught.value) is WorkerFailed
    assert "too large" in str(caught.value.__cause__)


async def test_a_url_that_is_not_http_is_a_worker_failure() -> None:
    async with hop() as client:
        with pytest.raises(WorkerFailed) as caught:
            await bounded(client.post("ftp://worker/v1", b"{}", HEADERS))
    assert type(caught.value) is WorkerFailed


async def test_a_header_with_a_line_break_is_never_sent() -> None:
    async with hop() as client:
        with pytest.raises(ValueError):
            await client.post("http://127.0.0.1:9/v1", b"{}", {"x-request-id": "a\r\nx: y"})


async def test_posting_before_start_is_a_programming_error() -> None:
    client = HopClient(UpstreamSettings(), max_connections=1)
    with pytest.raises(RuntimeError):
        await client.post("http://worker:8000/v1", b"{}", HEADERS)


# --- the body (HopResponse.read and .chunks) ----------------------------------------------------


async def test_a_whole_body_is_read() -> None:
    async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head(len(BODY)) + BODY)
        await writer.drain()

    async with worker(answer) as url, hop() as client:
        resp = await post(client, url)
        assert resp.status == 200
        assert resp.headers["content-type"] == "application/json"
        assert await bounded(resp.read()) == BODY


async def test_a_body_cut_mid_way_broke_off() -> None:
    async def cut(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head(100) + b'{"choices": [')
        await writer.drain()  # and the connection closes, 87 bytes short

    async with worker(cut) as url, hop() as client:
        resp = await post(client, url)
        with pytest.raises(WorkerBrokeOff) as caught:
            await bounded(resp.read())
    assert isinstance(caught.value.__cause__, Disconnected)
    assert caught.value.message == "The worker's answer broke off."


async def test_a_body_that_falls_silent_times_out() -> None:
    async with silent_after(head(100) + b'{"choices": [') as url, hop() as client:
        resp = await post(client, url)
        with pytest.raises(WorkerTimeout) as caught:
            await bounded(resp.read())
    assert caught.value.message == "The worker stopped answering."


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_body_past_the_bound_is_refused(chunked: bool) -> None:
    async def large(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if chunked:
            writer.write(streamed(b"x" * 4096) + b"0\r\n\r\n")
        else:
            writer.write(head(4096) + b"x" * 4096)
        await writer.drain()

    async with worker(large) as url, hop(max_response_bytes=1024) as client:
        resp = await post(client, url)
        with pytest.raises(WorkerFailed) as caught:
            await bounded(resp.read())
    assert type(caught.value) is WorkerFailed
    assert caught.value.message == "The worker's answer is too large."


async def test_a_stream_cut_mid_way_broke_off() -> None:
    async def cut(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(streamed(b"data: {}\n\n"))
        await writer.drain()  # and closes without the last chunk

    async with worker(cut) as url, hop() as client:
        resp = await post(client, url)
        with pytest.raises(WorkerBrokeOff) as caught:
            await bounded(collect(resp))
        resp.close()
    assert isinstance(caught.value.__cause__, Disconnected)
    assert caught.value.message == "The worker's stream broke off."


async def test_a_stream_with_a_bad_chunk_broke_off() -> None:
    async def bad(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(streamed(b"data: {}\n\n") + b"zz\r\n")
        await writer.drain()

    async with worker(bad) as url, hop() as client:
        resp = await post(client, url)
        with pytest.raises(WorkerBrokeOff) as caught:
            await bounded(collect(resp))
        resp.close()
    assert isinstance(caught.value.__cause__, NotHttp)


async def test_a_stream_that_falls_silent_times_out() -> None:
    async with silent_after(streamed(b"data: {}\n\n")) as url, hop() as client:
        resp = await post(client, url)
        with pytest.raises(WorkerTimeout) as caught:
            await bounded(collect(resp))
        resp.close()
    assert caught.value.message == "The worker stopped answering mid-stream."
