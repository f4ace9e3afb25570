"""The hop's error translation (routing/upstream.py): aiohttp's errors never leave the
module, each becomes the routing/errors.py `Worker*` error its branch names. Misbehaving
workers are raw sockets on 127.0.0.1; the errors no local socket can cause (a connect that
times out, a failed DNS lookup) are aiohttp's own exceptions, raised by a stand-in session."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import aiohttp
import pytest

from routing.errors import (
    RoutingError,
    WorkerBrokeOff,
    WorkerFailed,
    WorkerTimeout,
    WorkerUnreachable,
)
from routing.upstream import Upstream, UpstreamResponse, UpstreamSettings

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
async def upstream(**settings: Any) -> AsyncIterator[Upstream]:
    options = {"read_timeout_s": READ_TIMEOUT_S, **settings}
    up = Upstream(UpstreamSettings(**options), max_connections=4)
    await up.start()
    try:
        yield up
    finally:
        await up.close()


def stall(until: asyncio.Event) -> Callable[[], Awaitable[None]]:
    async def wait() -> None:
        await until.wait()

    return wait


def head(length: int) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
        length
    )


async def post(up: Upstream, url: str) -> UpstreamResponse:
    return await bounded(up.post(url + "/v1/chat/completions", b"{}", HEADERS))


def free_port() -> int:
    """A port nothing listens on (bound, then closed: a connect is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- before the answer's headers (Upstream.post) ------------------------------------------------


async def test_a_refused_connection_is_unreachable() -> None:
    async with upstream() as up:
        with pytest.raises(WorkerUnreachable) as caught:
            await post(up, f"http://127.0.0.1:{free_port()}")
    assert isinstance(caught.value.__cause__, aiohttp.ClientConnectorError)
    assert caught.value.message == "The worker could not be reached."


async def test_a_connection_closed_before_any_answer_is_unreachable() -> None:
    async def hang_up(_reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        return  # closes without a byte

    async with worker(hang_up) as url, upstream() as up:
        with pytest.raises(WorkerUnreachable) as caught:
            await post(up, url)
    assert isinstance(caught.value.__cause__, aiohttp.ServerDisconnectedError)


async def test_a_tls_handshake_that_fails_is_unreachable() -> None:
    """https:// to a worker that speaks plain HTTP: the handshake fails (an SSL error)."""

    async def plain(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    async with worker(plain, read_head=False) as url, upstream() as up:
        with pytest.raises(WorkerUnreachable) as caught:
            await bounded(up.post(url.replace("http:", "https:") + "/v1", b"{}", HEADERS))
    assert isinstance(caught.value.__cause__, aiohttp.ClientSSLError)


async def test_a_worker_silent_before_its_headers_times_out() -> None:
    release = asyncio.Event()

    async def silent(_reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
        await release.wait()

    try:
        async with worker(silent) as url, upstream() as up:
            with pytest.raises(WorkerTimeout) as caught:
                await post(up, url)
    finally:
        release.set()
    assert isinstance(caught.value.__cause__, aiohttp.ServerTimeoutError)
    assert caught.value.message == "The worker did not answer in time."


async def test_an_answer_that_is_not_http_is_a_worker_failure() -> None:
    async def garbage(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SPEAKING SOMETHING ELSE\r\n\r\n")
        await writer.drain()

    async with worker(garbage) as url, upstream() as up:
        with pytest.raises(WorkerFailed) as caught:
            await post(up, url)
    assert type(caught.value) is WorkerFailed
    assert isinstance(caught.value.__cause__, aiohttp.ClientResponseError)
    assert caught.value.message == "The worker answered garbage."


class RaisingSession:
    """A stand-in for the pooled session whose post raises `error`."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def post(self, *_args: Any, **_kwargs: Any) -> Any:
        raise self.error

    async def close(self) -> None:
        return None


KEY = SimpleNamespace(host="worker", port=8000, ssl=True)  # what aiohttp's errors print


@pytest.mark.parametrize(
    ("error", "kind", "message"),
    [
        (aiohttp.ConnectionTimeoutError(), WorkerUnreachable, "could not be reached in time"),
        (
            aiohttp.ClientConnectorDNSError(KEY, OSError(-2, "Name or service not known")),  # type: ignore[arg-type]
            WorkerUnreachable,
            "could not be reached.",
        ),
        (ConnectionResetError(104, "reset"), WorkerUnreachable, "could not be reached."),
        (TimeoutError(), WorkerTimeout, "did not answer in time"),
        (aiohttp.TooManyRedirects(None, ()), WorkerFailed, "answered garbage"),  # type: ignore[arg-type]
    ],
    ids=["connect-timeout", "dns", "os-error", "timeout", "other-client-error"],
)
async def test_errors_no_local_socket_causes_are_translated_too(
    error: BaseException, kind: type[RoutingError], message: str
) -> None:
    up = Upstream(UpstreamSettings(), max_connections=1)
    up._session = RaisingSession(error)  # type: ignore[assignment]
    with pytest.raises(kind) as caught:
        await bounded(up.post("http://worker:8000/v1", b"{}", HEADERS))
    assert type(caught.value) is kind
    assert caught.value.__cause__ is error
    assert message in caught.value.message


async def test_posting_before_start_is_a_programming_error() -> None:
    up = Upstream(UpstreamSettings(), max_connections=1)
    with pytest.raises(RuntimeError):
        await up.post("http://worker:8000/v1", b"{}", HEADERS)


# --- the body (UpstreamResponse.read and .chunks) -----------------------------------------------


async def test_a_whole_body_is_read() -> None:
    async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head(len(BODY)) + BODY)
        await writer.drain()

    async with worker(answer) as url, upstream() as up:
        resp = await post(up, url)
        assert resp.status == 200
        assert await bounded(resp.read()) == BODY


async def test_a_body_cut_mid_way_broke_off() -> None:
    async def cut(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head(100) + b'{"choices": [')
        await writer.drain()  # and the connection closes, 87 bytes short

    async with worker(cut) as url, upstream() as up:
        resp = await post(up, url)
        with pytest.raises(WorkerBrokeOff) as caught:
            await bounded(resp.read())
    assert isinstance(caught.value.__cause__, aiohttp.ClientPayloadError)
    assert caught.value.message == "The worker's answer broke off."


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


async def test_a_body_that_falls_silent_times_out() -> None:
    async with silent_after(head(100) + b'{"choices": [') as url, upstream() as up:
        resp = await post(up, url)
        with pytest.raises(WorkerTimeout) as caught:
            await bounded(resp.read())
    assert caught.value.message == "The worker stopped answering."


async def test_a_body_past_the_bound_is_refused() -> None:
    async def large(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head(4096) + b"x" * 4096)
        await writer.drain()

    async with worker(large) as url, upstream(max_response_bytes=1024) as up:
        resp = await post(up, url)
        with pytest.raises(WorkerFailed) as caught:
            await bounded(resp.read())
    assert type(caught.value) is WorkerFailed
    assert caught.value.message == "The worker's answer is too large."


async def collect(resp: UpstreamResponse) -> list[bytes]:
    return [chunk async for chunk in resp.chunks()]


def streamed(first: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(first), first)
    )


async def test_a_stream_cut_mid_way_broke_off() -> None:
    async def cut(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(streamed(b"data: {}\n\n"))
        await writer.drain()  # and closes without the last chunk

    async with worker(cut) as url, upstream() as up:
        resp = await post(up, url)
        with pytest.raises(WorkerBrokeOff) as caught:
            await bounded(collect(resp))
        resp.close()
    assert isinstance(caught.value.__cause__, aiohttp.ClientPayloadError)
    assert caught.value.message == "The worker's stream broke off."


async def test_a_stream_that_falls_silent_times_out() -> None:
    async with silent_after(streamed(b"data: {}\n\n")) as url, upstream() as up:
        resp = await post(up, url)
        with pytest.raises(WorkerTimeout) as caught:
            await bounded(collect(resp))
        resp.close()
    assert caught.value.message == "The worker stopped answering mid-stream."
