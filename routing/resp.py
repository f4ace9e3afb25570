"""A lean Redis client for the admission hot path: one connection, replies in order.

Redis answers the commands of a connection in the order it received them, so one TCP
connection can carry the calls of every concurrent request at once: each call writes its
commands straight to the socket and gets a future resolved, in FIFO order, when its replies
have been parsed (hiredis, in C). No connection-pool checkout, lock, per-call timeout or task
per call (redis-py spends more than the Lua scripts themselves on those, DESIGN.md). A call
that never gets an answer is failed by `fail_stalled`, which the keeper runs every sweep.

Used for redis:// and unix:// URLs; everything else (memory://, rediss://) goes through
redis-py. Errors are redis-py's exception types, so callers catch one family.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import unquote, urlparse

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

Command = Sequence[Any]


def pack(commands: Sequence[Command]) -> bytes:
    """RESP encoding of several commands, ready for one write."""
    out: list[bytes] = []
    for command in commands:
        out.append(b"*%d\r\n" % len(command))
        for arg in command:
            if isinstance(arg, bytes):
                data = arg
            elif isinstance(arg, str):
                data = arg.encode()
            elif isinstance(arg, float):
                data = repr(arg).encode()
            else:
                data = str(arg).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _error(reply: hiredis.ReplyError) -> ResponseError:
    message = str(reply)
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    return ResponseError(message)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self._reader = hiredis.Reader()
        self._pending: deque[tuple[asyncio.Future[list[Any]], int, list[Any], float]] = deque()
        self._transport: asyncio.Transport | None = None
        # Calls of one loop tick leave in one write: with many requests in flight this turns
        # a syscall per call into one per tick, at the cost of one tick of latency.
        self._out: list[bytes] = []
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but they write alike.
        self._transport = cast(asyncio.Transport, transport)

    def send(self, payload: bytes, count: int) -> asyncio.Future[list[Any]]:
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        if self.closed or self._transport is None:
            future.set_exception(RedisConnectionError("connection to Redis lost"))
            return future
        self._pending.append((future, count, [], time.monotonic()))
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(payload)
        return future

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self._transport is not None and not self.closed:
            self._transport.write(b"".join(out) if len(out) > 1 else out[0])

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        pending = self._pending
        while (reply := reader.gets()) is not False:
            if not pending:  # a reply nobody asked for: the stream is out of step
                self.abort()
                return
            future, count, replies, _ = pending[0]
            replies.append(_error(reply) if isinstance(reply, hiredis.ReplyError) else reply)
            if len(replies) == count:
                pending.popleft()
                if not future.done():
                    future.set_result(replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        error = RedisConnectionError(f"connection to Redis lost: {exc or 'closed'}")
        while self._pending:
            future = self._pending.popleft()[0]
            if not future.done():
                future.set_exception(error)

    def oldest_age(self, now: float) -> float:
        return now - self._pending[0][3] if self._pending else 0.0

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()


class RespClient:
    """One lazily (re)connected pipelining connection to a Redis server."""

    def __init__(self, url: str, *, connect_timeout_s: float = 2.0) -> None:
        parsed = urlparse(url)
        self._unix = parsed.path if parsed.scheme == "unix" else None
        self._host = parsed.hostname or "127.0.0.1"
        self._port = parsed.port or 6379
        db = parsed.path.lstrip("/") if parsed.scheme != "unix" else ""
        self._db = int(db) if db else 0
        self._username = unquote(parsed.username) if parsed.username else None
        self._password = unquote(parsed.password) if parsed.password else None
        self._connect_timeout = connect_timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None

    @staticmethod
    def supports(url: str) -> bool:
        return url.startswith(("redis://", "unix://"))

    def send(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        """Write the commands now; the future gets their replies (error replies as
        exception objects in the list; a lost connection as the future's exception)."""
        protocol = self._protocol
        if protocol is not None and not protocol.closed:
            return protocol.send(pack(commands), len(commands))
        return asyncio.ensure_future(self._send_connecting(commands))

    async def _send_connecting(self, commands: Sequence[Command]) -> list[Any]:
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
        protocol = await asyncio.shield(self._connecting)
        return await protocol.send(pack(commands), len(commands))

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                if self._unix is not None:
                    _, protocol = await loop.create_unix_connection(_Protocol, self._unix)
                else:
                    _, protocol = await loop.create_connection(_Protocol, self._host, self._port)
                setup: list[Command] = []
                if self._password is not None:
                    auth = [self._username, self._password] if self._username else [self._password]
                    setup.append(["AUTH", *auth])
                if self._db:
                    setup.append(["SELECT", self._db])
                if setup:
                    for reply in await protocol.send(pack(setup), len(setup)):
                        if isinstance(reply, Exception):
                            protocol.abort()
                            raise reply
        except TimeoutError as exc:
            raise RedisTimeoutError("connecting to Redis timed out") from exc
        except OSError as exc:
            raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
        self._protocol = protocol
        return protocol

    def fail_stalled(self, limit_s: float) -> bool:
        """Drop the connection if a call waited longer than `limit_s` (Redis hung): its
        callers then fail like on any lost connection. True when it did."""
        protocol = self._protocol
        if protocol is not None and protocol.oldest_age(time.monotonic()) > limit_s:
            protocol.abort()
            return True
        return False

    async def aclose(self) -> None:
        if self._protocol is not None:
            self._protocol.abort()
            self._protocol = None
