"""A lean Redis client for the admission hot path: one connection, replies in order.

Redis answers the commands of a connection in the order it received them, so one TCP
connection can carry the calls of every concurrent request at once: each call writes its
commands straight to the socket and gets a future resolved, in FIFO order, when its replies
have been parsed (hiredis, in C). No connection-pool checkout, lock, or timer or task per
call (redis-py spends more than the Lua scripts themselves on those, bench/README.md).

Deadlines: every call must be answered within `command_timeout_s` of being sent. Replies
come in order, so only the oldest pending call can be late first: one timer per connection,
set for the oldest call's deadline, checks it. If that call is late, Redis is stalled (a
SIGSTOP or a hung host keeps the TCP connection open): the connection is dropped, every
pending call fails with `TimeoutError`, and the next call connects again by itself.

Bounds: at most `max_pending` calls wait for replies and at most `max_buffer_bytes` wait to
be written; past either, a call fails at once with `ConnectionError` (an outage answer)
without being written. TCP keepalive finds a peer that vanished without a FIN. A Redis that
refused the connection's AUTH or SELECT is not asked again for a second: calls meanwhile
fail at once with its answer (a wrong password never heals by retrying).

Used for redis://, unix:// and redis+sentinel:// URLs (with a locator: routing/store/sentinel.py);
everything else (memory://, rediss://) goes through redis-py. Errors are redis-py's
exception types, so callers catch one family.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol, cast

import hiredis
from redis.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from routing.store.futures import chain
from routing.store.wire import Command, fold, pack, replies_of, reply_error, set_keepalive

# Far above what a healthy Redis ever has in flight from one replica (it runs 10,000 small
# scripts in well under a second, and a request has at most a couple of calls out), yet small
# in memory (a future and a short list each). Reaching it means Redis is far behind: failing
# the call at once as an outage beats queueing it behind calls that will time out anyway.
MAX_PENDING = 10_000
# What may sit unsent in this process when Redis stops reading (the kernel's socket buffer
# holds more before that): admission calls are a few hundred bytes, so this is thousands.
MAX_BUFFER_BYTES = 16 * 1024 * 1024
# A Redis that refused the connection's AUTH or SELECT (a wrong password, an ACL) will refuse
# again: for this long, calls fail with its answer at once instead of each connecting anew.
REFUSED_HOLD_S = 1.0


class NotSent(RedisConnectionError):
    """The calls never left this process (no connection, or too many calls waiting):
    Redis did nothing of them, so there is nothing to undo."""


class Demoted(RedisConnectionError):
    """The node reached as the master answered as a replica (Sentinel moved the master)."""


def _timeout(limit_s: float) -> RedisTimeoutError:
    return RedisTimeoutError(f"Redis did not answer within {limit_s:g} s")


class _Protocol(asyncio.Protocol):
    def __init__(
        self, timeout_s: float, max_pending: int, max_buffer_bytes: int, follow: bool = False
    ) -> None:
        self._loop = asyncio.get_running_loop()
        # Behind Sentinel: a READONLY reply means this node was demoted (a failover kept the
        # connection open): drop it, so that the next call asks the sentinels again.
        self._follow = follow
        self._reader = hiredis.Reader()
        # (future, replies expected, replies so far, deadline on the loop's clock)
        self._pending: deque[tuple[asyncio.Future[list[Any]], int, list[Any], float]] = deque()
        self._transport: asyncio.Transport | None = None
        self._timeout_s = timeout_s
        self._max_pending = max_pending
        self._max_buffer = max_buffer_bytes
        # At most one, set for the oldest pending call's deadline (or an earlier one's).
        self._timer: asyncio.TimerHandle | None = None
        # Calls of one loop tick leave in one write: with many requests in flight this turns
        # a syscall per call into one per tick, at the cost of one tick of latency.
        self._out: list[bytes] = []
        self._out_bytes = 0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but they write alike.
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            set_keepalive(sock)

    def send(
        self, payload: bytes, count: int, deadline: float | None = None
    ) -> asyncio.Future[list[Any]]:
        """Queue `payload` (`count` commands) for this tick's write. `deadline` (loop clock)
        defaults to `command_timeout_s` from now."""
        loop = self._loop
        future: asyncio.Future[list[Any]] = loop.create_future()
        transport = self._transport
        if self.closed or transport is None:
            future.set_exception(NotSent("connection to Redis lost"))
            return future
        pending = self._pending
        if (
            len(pending) >= self._max_pending
            or self._out_bytes + transport.get_write_buffer_size() >= self._max_buffer
        ):
            future.set_exception(NotSent("too many calls waiting for Redis"))
            return future
        if deadline is None:
            deadline = loop.time() + self._timeout_s
        elif pending and pending[-1][3] > deadline:
            deadline = pending[-1][3]  # keep deadlines in reply order: the head is due first
        elif self._timer is not None and self._timer.when() > deadline:
            self._timer.cancel()  # set for a later call already answered: this one is due first
            self._timer = None
        pending.append((future, count, [], deadline))
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._check_deadline)
        if not self._out:
            loop.call_soon(self._flush)
        self._out.append(payload)
        self._out_bytes += len(payload)
        return future

    def _flush(self) -> None:
        out, self._out, self._out_bytes = self._out, [], 0
        if self._transport is not None and not self.closed and out:
            self._transport.write(b"".join(out) if len(out) > 1 else out[0])

    def _check_deadline(self) -> None:
        self._timer = None
        if self.closed or not self._pending:
            return  # the next call sets the timer again
        deadline = self._pending[0][3]
        if self._loop.time() < deadline:  # set for a call answered since: wait for this one
            self._timer = self._loop.call_at(deadline, self._check_deadline)
            return
        self.abort(_timeout(self._timeout_s))

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        pending = self._pending
        while (reply := reader.gets()) is not False:
            if not pending:  # a reply nobody asked for: the stream is out of step
                self.abort(RedisConnectionError("unexpected reply from Redis"))
                return
            future, count, replies, _ = pending[0]
            if isinstance(reply, hiredis.ReplyError):
                reply = reply_error(reply)
                if self._follow and str(reply).startswith("READONLY"):
                    self.abort(Demoted("the master was demoted (a failover): reconnecting"))
                    return
            replies.append(reply)
            if len(replies) == count:
                pending.popleft()
                if not future.done():
                    future.set_result(replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self._close(RedisConnectionError(f"connection to Redis lost: {exc or 'closed'}"))

    def abort(self, error: RedisError) -> None:
        """Drop the connection now; calls still waiting fail with `error`."""
        self._close(error)
        if self._transport is not None:
            self._transport.abort()

    def _close(self, error: RedisError) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._out, self._out_bytes = [], 0
        while self._pending:
            future = self._pending.popleft()[0]
            if not future.done():
                future.set_exception(error)


class Locator(Protocol):
    """Where the master is now (routing/store/sentinel.py `Sentinels`)."""

    async def locate(self) -> tuple[str, int]: ...

    async def aclose(self) -> None: ...


class RespClient:
    """One lazily (re)connected pipelining connection to a Redis server. With a `locator`
    (Sentinel), the address is asked at each (re)connect, the node must answer ROLE as a
    master, and while connected the locator is asked every `watch_s`: another answer drops
    the connection, as does a READONLY reply."""

    def __init__(
        self,
        url: str,
        *,
        locator: Locator | None = None,
        watch_s: float = 0.5,
        connect_timeout_s: float = 2.0,
        command_timeout_s: float = 2.0,
        max_pending: int = MAX_PENDING,
        max_buffer_bytes: int = MAX_BUFFER_BYTES,
    ) -> None:
        # redis-py's reading of the URL, so both clients reach the same database (a `?db=`
        # query, a unix socket's too, wins over the path, as redis-py has it).
        parsed: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]
        self._unix: str | None = parsed.get("path")
        self._host = parsed.get("host") or "127.0.0.1"
        self._port = int(parsed.get("port") or 6379)
        self._db = int(parsed.get("db") or 0)
        self._username: str | None = parsed.get("username")
        self._password: str | None = parsed.get("password")
        self._connect_timeout = connect_timeout_s
        self._timeout = command_timeout_s
        self._limits = (max_pending, max_buffer_bytes)
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None
        # (until when on the loop's clock, Redis's refusal of the last setup)
        self._refused: tuple[float, ResponseError] | None = None
        self._locator = locator
        self._watch_s = watch_s
        self._watch: asyncio.Task[None] | None = None
        self._at: tuple[str, int] | None = None  # where the locator said the master was
        # Times the locator named another master than the last one connected to.
        self.moves: int | None = None if locator is None else 0
        self.one_node = True

    @staticmethod
    def supports(url: str) -> bool:
        return url.startswith(("redis://", "unix://"))

    def send(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        """Write the commands now; the future gets their replies (error replies as
        exception objects in the list; a lost connection, a full queue or a call not
        answered within `command_timeout_s` as the future's exception; an argument that
        cannot be encoded as `DataError`, nothing sent). The `Store` of routing/store/base.py."""
        try:
            payload = pack(commands)
        except UnicodeError as exc:  # an argument Redis could not be sent: not an outage
            failed: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
            failed.set_exception(DataError(f"cannot encode a Redis argument: {exc}"))
            return failed
        count = replies_of(commands)
        protocol = self._protocol
        if protocol is not None and not protocol.closed:
            sent = protocol.send(payload, count)
        else:
            deadline = asyncio.get_running_loop().time() + self._timeout
            sent = asyncio.ensure_future(self._send_connecting(payload, count, deadline))
        if count == len(commands):
            return sent
        return _folded(commands, sent)

    async def _send_connecting(self, payload: bytes, count: int, deadline: float) -> list[Any]:
        # The wait for a connection counts against the call's own deadline.
        refused = self._refused
        if refused is not None and asyncio.get_running_loop().time() < refused[0]:
            raise NotSent(str(refused[1])) from refused[1]
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
        try:
            async with asyncio.timeout_at(deadline):
                protocol = await asyncio.shield(self._connecting)
        except TimeoutError as exc:
            raise NotSent(str(_timeout(self._timeout))) from exc
        except RedisError as exc:
            raise NotSent(str(exc)) from exc
        if asyncio.get_running_loop().time() >= deadline:  # due already: spare the new link
            raise NotSent(str(_timeout(self._timeout)))
        return await protocol.send(payload, count, deadline)

    async def _connect(self) -> _Protocol:
        try:
            # A stalled Redis still completes TCP handshakes (its kernel does) but never
            # answers AUTH/SELECT: the whole setup is bounded, not only the handshake.
            async with asyncio.timeout(self._connect_timeout):
                protocol = await self._open()
        except TimeoutError as exc:  # before OSError: TimeoutError is one
            raise RedisTimeoutError(
                f"connecting to Redis timed out after {self._connect_timeout:g} s"
            ) from exc
        except OSError as exc:
            raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
        except ResponseError as exc:
            self._refused = (asyncio.get_running_loop().time() + REFUSED_HOLD_S, exc)
            raise
        self._refused = None
        self._protocol = protocol
        return protocol

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()

        def factory() -> _Protocol:
            return _Protocol(self._timeout, *self._limits, follow=self._locator is not None)

        if self._unix is not None:
            _, protocol = await loop.create_unix_connection(factory, self._unix)
        elif self._locator is not None:
            at = await self._locator.locate()
            if self._at is not None and at != self._at and self.moves is not None:
                self.moves += 1
            self._at = at
            _, protocol = await loop.create_connection(factory, *at)
        else:
            _, protocol = await loop.create_connection(factory, self._host, self._port)
        try:
            await self._setup(protocol)
        except BaseException:  # a timeout or cancel too: never leave the socket open
            protocol.abort(RedisConnectionError("connection setup failed"))
            raise
        return protocol

    async def _setup(self, protocol: _Protocol) -> None:
        setup: list[Command] = []
        if self._password is not None:
            auth = [self._username, self._password] if self._username else [self._password]
            setup.append(["AUTH", *auth])
        if self._db:
            setup.append(["SELECT", self._db])
        if self._locator is not None:
            setup.append(["ROLE"])
        replies = await protocol.send(pack(setup), len(setup)) if setup else []
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        if self._locator is not None:
            _master_role(replies[-1])
            if self._watch is None or self._watch.done():
                self._watch = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        """Drop the connection when the locator names another master."""
        assert self._locator is not None
        while True:
            await asyncio.sleep(self._watch_s)
            protocol = self._protocol
            if protocol is None or protocol.closed:
                continue
            try:
                address = await self._locator.locate()
            except (RedisError, OSError):
                continue  # no answer: keep what is connected
            if address != self._at and protocol is self._protocol:
                protocol.abort(Demoted("the sentinels name another master: reconnecting"))

    async def aclose(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._locator is not None:
            await self._locator.aclose()
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        if self._protocol is not None:
            self._protocol.abort(RedisConnectionError("client closed"))
            self._protocol = None


def _folded(
    commands: Sequence[Command], sent: asyncio.Future[list[Any]]
) -> asyncio.Future[list[Any]]:
    """One reply per command, a transaction's replies folded into one (routing/store/wire.py)."""
    outer: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()

    def done(sent: asyncio.Future[list[Any]]) -> None:
        if sent.cancelled() or sent.exception() is not None:
            chain(outer, sent)
        elif not outer.done():
            outer.set_result(fold(commands, sent.result()))

    sent.add_done_callback(done)
    return outer


def _master_role(reply: Any) -> None:
    """Refuse a node that is not (or no longer) a master: the sentinels' answer was stale."""
    role = reply[0] if isinstance(reply, list) and reply else b""
    if role != b"master":
        name = role.decode(errors="replace") if isinstance(role, bytes) else str(role)
        raise Demoted(f"the node the sentinels named is not a master ({name})")
