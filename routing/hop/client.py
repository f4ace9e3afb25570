"""The hop to GPU workers: pooled keep-alive HTTP/1.1 connections (routing/hop/http1.py).

`post` gives a response with `status`, `headers`, `read`, `chunks`, `close`; failures are
routing/errors.py `Worker*` errors, translated as the aiohttp client this replaced did, at a
fraction of its CPU (bench/README.md).

Pool: idle connections per endpoint (scheme, host, port), the most recent reused first; at
most `max_connections` open in all (a request past it waits, within the connect timeout,
or closes an idle connection of another endpoint). An idle connection is dropped after
`KEEPALIVE_S`, before the worker drops it (uvicorn, and so vLLM and SGLang, close theirs
after 5 s), and as soon as the worker closes it. A request sent on a reused connection that
the worker closed before a byte of its answer (or whose write failed) is sent once more, on a
new connection: the worker never saw it. A connection goes back to the pool only when its
answer was read to the end; everything else (cancel, error, oversize) closes it.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

from routing.errors import WorkerBrokeOff, WorkerFailed, WorkerTimeout, WorkerUnreachable
from routing.hop.http1 import Connection, Disconnected, NotHttp, Silent
from routing.hop.upstream import KEEPALIVE_S, UpstreamSettings

# Parsed request targets kept (endpoints times routes: a handful in practice).
MAX_TARGETS = 1024


class Target(NamedTuple):
    """Where a URL's requests go: the pool's key and what the request head starts with."""

    key: tuple[str, str, int]  # scheme, host, port
    head: bytes  # request line and host header


def target(url: str) -> Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WorkerFailed("The worker answered garbage.")  # aiohttp's InvalidURL, as before
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.netloc.rpartition("@")[2]
    head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\n".encode()
    return Target((parts.scheme, parts.hostname, port), head)


def encode(tgt: Target, body: bytes, headers: Mapping[str, str]) -> bytes:
    """The whole request, one buffer. A header with a line break is refused (as aiohttp did):
    it would smuggle a header or a request to the worker."""
    lines = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
        raise ValueError("a line break in a header for the worker")
    return b"".join((tgt.head, lines.encode(), b"content-length: %d\r\n\r\n" % len(body), body))


class ConnectionPool:
    """Open connections per endpoint key, bounded in all."""

    def __init__(self, settings: UpstreamSettings, limit: int) -> None:
        self._settings = settings
        self._limit = limit
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}
        self._open: set[Connection] = set()
        self._connecting = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tls: ssl.SSLContext | None = None

    @property
    def size(self) -> int:
        """Connections open or being opened."""
        return len(self._open) + self._connecting

    def idle(self, key: tuple[str, str, int]) -> Connection | None:
        """The most recently used idle connection to `key` still fit for reuse, or None."""
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest = asyncio.get_running_loop().time() - KEEPALIVE_S
        while idle:
            conn = idle.pop()
            if conn.idle_since > oldest and not conn.closed:
                return conn
            conn.close()
        return None

    async def connect(self, key: tuple[str, str, int]) -> Connection:
        """A new connection to `key`, within the connect timeout (a wait for room included)."""
        async with asyncio.timeout(self._settings.connect_timeout_s):
            while self.size >= self._limit and not self._close_an_idle():
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                finally:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)
            self._connecting += 1
            try:
                return await self._open_one(key)
            finally:
                self._connecting -= 1
                self._wake_one()

    async def _open_one(self, key: tuple[str, str, int]) -> Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        read_timeout = self._settings.read_timeout_s
        tls = self._tls_context() if scheme == "https" else None
        _, conn = await loop.create_connection(
            lambda: Connection(read_timeout, self._gone), host, port, ssl=tls
        )
        if not conn.closed:
            self._open.add(conn)
        return conn

    def put(self, key: tuple[str, str, int], conn: Connection) -> None:
        """A connection whose exchange is over: kept if its answer ended cleanly."""
        conn.finish()
        if conn.reusable:
            self._idle.setdefault(key, []).append(conn)
            self._wake_one()
        else:
            conn.close()

    async def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()

    def _gone(self, conn: Connection) -> None:
        self._open.discard(conn)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _close_an_idle(self) -> bool:
        """Room made by closing the longest idle connection of any endpoint."""
        lists = [idle for idle in self._idle.values() if idle]
        if not lists:
            return False
        oldest = min(lists, key=lambda idle: idle[0].idle_since)
        oldest.pop(0).close()
        return True

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls


class HopResponse:
    """A worker's answer whose head has arrived; the body is read or streamed once."""

    __slots__ = ("_conn", "_key", "_max_bytes", "_pool", "headers", "status")

    def __init__(
        self, pool: ConnectionPool, key: tuple[str, str, int], conn: Connection, status: int,
        max_bytes: int,
    ) -> None:  # fmt: skip
        self._pool = pool
        self._key = key
        self._conn: Connection | None = conn
        self._max_bytes = max_bytes
        self.status = status
        self.headers: Mapping[str, str] = conn.headers

    async def read(self) -> bytes:
        """The whole body (bounded), then the connection goes back to the pool."""
        conn = self._conn
        assert conn is not None, "the body was taken already"
        try:
            body = bytearray()
            while (chunk := await conn.next_chunk()) is not None:
                body += chunk
                if len(body) > self._max_bytes:
                    raise WorkerFailed("The worker's answer is too large.")
            return bytes(body)
        except Silent as exc:
            raise WorkerTimeout("The worker stopped answering.") from exc
        except (Disconnected, NotHttp) as exc:
            raise WorkerBrokeOff("The worker's answer broke off.") from exc
        finally:
            self.release()

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive from the worker."""
        return _Chunks(self)

    def close(self) -> None:
        """Done with the answer: its connection is reused if it was read to the end, else
        dropped (a worker like vLLM aborts the request and frees its KV cache)."""
        self.release()

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.put(self._key, conn)


class _Chunks:
    """The body as an async iterator without an async generator (nothing for the loop to
    finalise in a task of its own when the caller stops early)."""

    __slots__ = ("_resp",)

    def __init__(self, resp: HopResponse) -> None:
        self._resp = resp

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        conn = self._resp._conn
        if conn is None:  # closed: its connection may carry another answer by now
            raise WorkerBrokeOff("The worker's stream broke off.")
        try:
            chunk = await conn.next_chunk()
        except Silent as exc:
            raise WorkerTimeout("The worker stopped answering mid-stream.") from exc
        except (Disconnected, NotHttp) as exc:
            raise WorkerBrokeOff("The worker's stream broke off.") from exc
        if chunk is None:
            raise StopAsyncIteration
        return chunk


class HopClient:
    """Posts JSON to workers over pooled connections. Build in the lifespan, close on exit."""

    def __init__(self, settings: UpstreamSettings, max_connections: int) -> None:
        self._settings = settings
        self._max_connections = max_connections
        self._pool: ConnectionPool | None = None
        self._targets: dict[str, Target] = {}

    async def start(self) -> None:
        self._pool = ConnectionPool(self._settings, self._max_connections)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> HopResponse:
        pool = self._pool
        if pool is None:
            raise RuntimeError("HopClient.start() was not called")
        tgt = self._targets.get(url)
        if tgt is None:
            tgt = target(url)
            if len(self._targets) >= MAX_TARGETS:
                self._targets.clear()
            self._targets[url] = tgt
        data = encode(tgt, body, headers)
        conn = pool.idle(tgt.key)
        if conn is not None:
            try:
                return await self._exchange(pool, tgt.key, conn, data)
            except Disconnected as exc:
                if exc.answered:  # the worker may have seen the request: not sent again
                    raise WorkerUnreachable("The worker could not be reached.") from exc
            # A stale keep-alive connection: sent once more, on a new one.
        conn = await self._connect(pool, tgt.key)
        try:
            return await self._exchange(pool, tgt.key, conn, data)
        except Disconnected as exc:
            raise WorkerUnreachable("The worker could not be reached.") from exc

    async def _connect(self, pool: ConnectionPool, key: tuple[str, str, int]) -> Connection:
        try:
            return await pool.connect(key)
        except TimeoutError as exc:
            raise WorkerUnreachable("The worker could not be reached in time.") from exc
        except OSError as exc:
            raise WorkerUnreachable("The worker could not be reached.") from exc

    async def _exchange(
        self, pool: ConnectionPool, key: tuple[str, str, int], conn: Connection, data: bytes
    ) -> HopResponse:
        """The answer's head to `data` on `conn`. Raises `Disconnected` (for `post` to
        judge), `Worker*` errors for the rest; `conn` is closed on any failure."""
        try:
            status = await conn.request(data)
        except Silent as exc:
            raise WorkerTimeout("The worker did not answer in time.") from exc
        except NotHttp as exc:
            raise WorkerFailed("The worker answered garbage.") from exc
        except BaseException:
            conn.close()  # a failure closed it already; a cancelled wait closes it here
            raise
        return HopResponse(pool, key, conn, status, self._settings.max_response_bytes)
