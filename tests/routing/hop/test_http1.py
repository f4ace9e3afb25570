"""The HTTP/1.1 client protocol and its pool (routing/hop/http1.py, routing/hop/client.py) against
real servers on 127.0.0.1: odd chunk boundaries, keep-alive reuse, a worker that closes a
kept connection, cancel = close, the pool's bound and reading paused for a lagging caller."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from routing.errors import WorkerBrokeOff
from routing.hop.client import HopClient
from routing.hop.http1 import HIGH_WATER, Connection
from routing.hop.upstream import UpstreamSettings
from tests.routing.hop.test_hopclient import BOUND_S, HEADERS, bounded, head, worker

EVENTS = b"".join(b'data: {"n": %d}\n\n' % i for i in range(40)) + b"data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def hop(max_connections: int = 4, **settings: Any) -> AsyncIterator[HopClient]:
    client = HopClient(UpstreamSettings(**settings), max_connections=max_connections)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


def chunked_in_odd_pieces(body: bytes) -> list[bytes]:
    """`body` chunk-encoded in chunks of 1, 2, 3... bytes, the wire cut across them again."""
    wire = bytearray(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    i, size = 0, 1
    while i < len(body):
        part = body[i : i + size]
        wire += b"%x\r\n%s\r\n" % (len(part), part)
        i, size = i + size, size % 7 + 1
    wire += b"0\r\n\r\n"
    return [bytes(wire[j : j + 5]) for j in range(0, len(wire), 5)]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head_bytes = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head_bytes.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    return head_bytes + await reader.readexactly(length)


@contextlib.asynccontextmanager
async def keep_alive_worker(answers: list[bytes]) -> AsyncIterator[tuple[str, list[int]]]:
    """Answers each request with the next of `answers` (a connection serves many);
    yields its URL and the number of requests each connection served."""
    served: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(0)
        me = len(served) - 1
        while answers:
            await read_request(reader)
            served[me] += 1
            writer.write(answers.pop(0))
            await writer.drain()

    async with worker(serve, read_head=False) as url:
        yield url, served


async def test_a_chunked_body_cut_at_odd_places_arrives_whole() -> None:
    pieces = chunked_in_odd_pieces(EVENTS)

    async def dribble(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()

    async with worker(dribble) as url, hop() as client:
        resp = await bounded(client.post(url + "/v1", b"{}", HEADERS))
        got = [chunk async for chunk in resp.chunks()]
        resp.close()
        streamed = b"".join(got)
        resp = await bounded(client.post(url + "/v1", b"{}", HEADERS))
        read = await bounded(resp.read())
    assert streamed == read == EVENTS


async def test_a_kept_connection_carries_the_next_request() -> None:
    answers = [head(2) + b"{}", head(3) + b"[1]"]
    async with keep_alive_worker(answers) as (url, served), hop() as client:
        first = await bounded(client.post(url + "/v1", b"{}", HEADERS))
        assert await bounded(first.read()) == b"{}"
        second = await bounded(client.post(url + "/v1", b'{"a": 1}', HEADERS))
        assert await bounded(second.read()) == b"[1]"
    assert served == [2]


async def test_the_request_the_worker_gets() -> None:
    seen: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(head(2) + b"{}")
        await writer.drain()

    async with worker(record, read_head=False) as url, hop() as client:
        resp = await bounded(client.post(url + "/v1/x?y=1", b'{"a":1}', {"x-request-id": "r1"}))
        await bounded(resp.read())
    host = url.removeprefix("http://")
    assert seen == [
        f"POST /v1/x?y=1 HTTP/1.1\r\nhost: {host}\r\nx-request-id: r1\r\n"
        'content-length: 7\r\n\r\n{"a":1}'.encode()
    ]


async def test_an_answer_with_connection_close_is_not_reused() -> None:
    closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
    answers = [closing, closing]
    async with keep_alive_worker(answers) as (url, served), hop() as client:
        for _ in range(2):
            resp = await bounded(client.post(url + "/v1", b"{}", HEADERS))
            assert await bounded(resp.read()) == b"{}"
    assert served == [1, 1]


async def test_a_body_ended_by_the_connection_is_whole() -> None:
    async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + b"[1,2]")
        await writer.drain()

    async with worker(answer) as url, hop() as client:
        resp = await bounded(client.post(url + "/v1", b"{}", HEADERS))
        assert await bounded(resp.read()) == b"[1,2]"


async def test_a_kept_connection_the_worker_closed_is_not_used() -> None:
    """The worker closes its idle connection (as uvicorn does after 5 s): the EOF is seen
    before the next request, which goes out on a new connection."""
    closed = asyncio.Event()

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head(2) + b"{}")
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        closed.set()

    async with worker(once, read_head=False) as url, hop() as client:
        pool, forgotten = client._pool, asyncio.Event()
        assert pool is not None
        forget = pool._gone

        def noted(conn: Connection) -> None:
            forget(conn)
            forgotten.set()

        pool._gone = noted  # type: ignore[method-assign]
        resp = await bounded(client.post(url + "/v1", b"{}", HEADERS))
        await bounded(resp.read())
        await bounded(closed.wait())
        await bounded(forgotten.wait())  # the worker's EOF reached the idle connection
        assert pool.size == 0
        resp = await bounded(client.post(url + "/v1", b"{}", HEADERS))
        assert await bounded(resp.read()) == b"{}"


async def test_a_request_on_a_stale_kept_connection_is_sent_once_more() -> None:
    """The worker read the request but closed without a byte of answer, on a connection
    that had served before (its keep-alive ran out as the request came): sent again, on a
    new connection. A request on a new connection is never sent twice."""
    requests: list[int] = []

    async def flaky(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        requests.append(1)
        writer.write(head(2) + b"{}")
        await writer.drain()
        await read_request(reader)  # the next one on this connection: hung up on
        requests.append(2)

    async with worker(flaky, read_head=False) as url, hop() as client:
        resp = await bounded(client.post(url + "/v1", b"{}", HEADERS))
        await bounded(resp.read())
        resp = await bounded(client.post(url + "/v1", b"{}", HEADERS))
        assert await bounded(resp.read()) == b"{}"
    assert requests == [1, 2, 1]


async def test_a_cancelled_request_closes_its_connection() -> None:
    arrived, gone = asyncio.Event(), asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        arrived.set()
        await reader.read()  # until the client closes
        gone.set()

    async with worker(hold, read_head=False) as url, hop() as client:
        task = asyncio.get_running_loop().create_task(client.post(url + "/v1", b"{}", HEADERS))
        await bounded(arrived.wait())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await bounded(gone.wait())
        assert client._pool is not None and client._pool.size == 0


async def test_a_stream_closed_before_its_end_closes_the_connection() -> None:
    gone = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await reader.read()  # until the client closes
        gone.set()

    async with worker(endless, read_head=False) as url, hop() as client:
        resp = await bounded(client.post(url + "/v1", b"{}", HEADERS))
        chunks = aiter(resp.chunks())
        assert await bounded(anext(chunks)) == b"hello"
        resp.close()
        await bounded(gone.wait())
        with pytest.raises(WorkerBrokeOff):  # never the next answer its connection carries
            await anext(chunks)
        assert client._pool is not None and client._pool.size == 0


async def test_the_pool_never_opens_more_than_its_bound() -> None:
    release, two = asyncio.Event(), asyncio.Event()
    open_now, most = 0, 0

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now, most
        open_now += 1
        most = max(most, open_now)
        if open_now == 2:
            two.set()
        try:
            while True:
                await read_request(reader)
                await release.wait()
                writer.write(head(2) + b"{}")
                await writer.drain()
        finally:
            open_now -= 1

    async def one(client: HopClient, url: str) -> bytes:
        resp = await client.post(url + "/v1", b"{}", HEADERS)
        return await resp.read()

    async with worker(slow, read_head=False) as url, hop(max_connections=2) as client:
        calls = [asyncio.get_running_loop().create_task(one(client, url)) for _ in range(5)]
        await bounded(two.wait())  # two requests reached the worker; three wait for room
        for _ in range(10):  # and stay waiting while the loop turns
            await asyncio.sleep(0)
        assert client._pool is not None and client._pool.size == 2
        release.set()
        assert await bounded(asyncio.gather(*calls)) == [b"{}"] * 5
    assert most == 2


async def test_reading_pauses_while_the_caller_lags() -> None:
    """A worker sending 16 MB to a caller that takes nothing: the client holds at most about
    HIGH_WATER of it (the rest waits in TCP), then the whole body arrives intact."""
    size, piece = 16 * 1024 * 1024, bytes(range(256)) * 256

    async def flood(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head(size))
        for _ in range(size // len(piece)):
            writer.write(piece)
            await writer.drain()

    async with worker(flood) as url, hop(max_response_bytes=size) as client:
        resp = await bounded(client.post(url + "/v1", b"{}", HEADERS))
        conn = resp._conn
        assert conn is not None
        for _ in range(int(BOUND_S * 1000)):  # until reading pauses
            if conn._paused:
                break
            await asyncio.sleep(0.001)
        assert conn._paused
        assert conn._buffered <= HIGH_WATER + 256 * 1024  # one read past the mark at most
        body = await bounded(resp.read())
    assert len(body) == size and body[: len(piece)] == piece
