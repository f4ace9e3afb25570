"""The lean pipelining Redis client of the admission hot path: against the real Redis
(stalled for real with SIGSTOP too), and against a fake TCP server that reads and answers
only when told, so the deadline and the bounds are tested without Redis as well."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from routing.store.resp import NotSent, RespClient
from routing.store.wire import Command, pack
from tests.conftest import REDIS_URL
from tests.redis_server import RedisServer


@pytest.fixture
async def client() -> AsyncIterator[RespClient]:
    made = RespClient(REDIS_URL)
    yield made
    await made.aclose()


def test_pack_is_resp() -> None:
    assert pack([["SET", "k", 1.5], [b"GET", "k"]]) == (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\n1.5\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
    )


def test_pack_gives_the_same_bytes_through_hiredis_and_without() -> None:
    # Tuples of str/int/float/bytes go through hiredis's C encoder; lists and other types
    # (bool) through the Python one: the bytes must not depend on which.
    args = ("EVALSHA", "s" * 40, 3, "k", -7, 10**20, 0.1, 1e17, 5e-324, b"\x00\xff", "h\u00e9")
    expected = _resp(args)
    assert pack([args]) == pack([list(args)]) == expected
    assert pack([("SET", "k", True)]) == _resp(("SET", "k", "True"))
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate is never sent half-encoded
        pack([("SET", "k", "\ud800")])


def _resp(args: tuple[object, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = (
            arg
            if isinstance(arg, bytes)
            else (repr(arg) if isinstance(arg, float) else str(arg)).encode()
        )
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


async def test_replies_come_back_to_their_callers_in_order(client: RespClient) -> None:
    calls = [client.send([["ECHO", f"a{i}"], ["ECHO", f"b{i}"]]) for i in range(200)]
    replies = await asyncio.gather(*calls)
    assert replies == [[f"a{i}".encode(), f"b{i}".encode()] for i in range(200)]


async def test_the_url_selects_the_database(client: RespClient) -> None:
    await client.send([["SET", "gw:resp-test", "here"]])
    try:
        db = REDIS_URL.rsplit("/", 1)[1]
        assert f" db={db} ".encode() in (await client.send([["CLIENT", "INFO"]]))[0]
    finally:
        await client.send([["DEL", "gw:resp-test"]])


async def test_error_replies_are_redis_py_exceptions(client: RespClient) -> None:
    replies = await client.send([["EVALSHA", "0" * 40, 0], ["NOSUCHCOMMAND"], ["PING"]])
    assert isinstance(replies[0], NoScriptError)
    assert isinstance(replies[1], ResponseError)
    assert replies[2] == b"PONG"


async def test_a_lost_connection_fails_pending_calls_then_reconnects(client: RespClient) -> None:
    own_id = (await client.send([["CLIENT", "ID"]]))[0]
    killer = RespClient(REDIS_URL)
    try:
        blocked = client.send([["BLPOP", "gw:resp-test-never", 5]])
        await killer.send([["CLIENT", "KILL", "ID", own_id]])
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(blocked, 5)
    finally:
        await killer.aclose()
    assert await client.send([["PING"]]) == [b"PONG"]


async def test_nothing_listening_is_a_connection_error() -> None:
    dead = RespClient("redis://127.0.0.1:1/0", connect_timeout_s=0.5)
    with pytest.raises(RedisConnectionError):
        await dead.send([["PING"]])


class FakeRedis:
    """A TCP server on 127.0.0.1 that reads everything it is sent and answers `+PONG` only
    when told to (on its latest connection): Redis stalled, or merely slow, on demand."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.connections = 0
        self.closed_by_client = asyncio.Event()
        self._changed = asyncio.Event()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> FakeRedis:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    def url(self, db: int = 0) -> str:
        assert self._server is not None
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/{db}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while data := await reader.read(1 << 16):
                self.received += data
                self._changed.set()
        except ConnectionError:
            pass  # the client aborted: a reset, not a FIN
        self.closed_by_client.set()

    async def wait_received(self, needle: bytes, count: int = 1) -> None:
        while self.received.count(needle) < count:
            self._changed.clear()
            await self._changed.wait()

    def answer(self, replies: int = 1) -> None:
        self._writers[-1].write(b"+PONG\r\n" * replies)

    async def close(self) -> None:
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@pytest.fixture
async def fake() -> AsyncIterator[FakeRedis]:
    server = await FakeRedis().start()
    try:
        yield server
    finally:
        await server.close()


class Settling(RespClient):
    """A RespClient that, once closed, collects the outcome of every call a test left
    unanswered (no "exception was never retrieved" noise)."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.sent: list[asyncio.Future[list[Any]]] = []

    def send(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        future = super().send(commands)
        self.sent.append(future)
        return future

    async def aclose(self) -> None:
        await super().aclose()
        await asyncio.wait_for(asyncio.gather(*self.sent, return_exceptions=True), 5)


Make = Callable[..., Settling]


@pytest.fixture
async def make() -> AsyncIterator[Make]:
    made: list[Settling] = []

    def factory(url: str, **options: Any) -> Settling:
        made.append(Settling(url, **options))
        return made[-1]

    yield factory
    for client in made:
        await client.aclose()


@pytest.mark.slow
async def test_a_stalled_redis_fails_calls_at_the_deadline_and_recovers(
    private_redis: RedisServer, make: Make
) -> None:
    client = make(private_redis.url, command_timeout_s=0.3, connect_timeout_s=0.3)
    assert await asyncio.wait_for(client.send([["PING"]]), 5) == [b"PONG"]
    private_redis.pause()  # SIGSTOP: the connection stays open, nothing answers
    try:
        first = [client.send([["PING"]]) for _ in range(20)]
        for call in first:
            with pytest.raises(RedisTimeoutError, match=r"did not answer within 0\.3 s"):
                await asyncio.wait_for(call, 5)
        for _ in range(3):  # calls during the stall: a new connection each, no hang
            with pytest.raises(RedisTimeoutError):
                await asyncio.wait_for(client.send([["PING"]]), 5)
    finally:
        private_redis.resume()
    # The same client, not rebuilt, answers again.
    assert await asyncio.wait_for(client.send([["PING"]]), 5) == [b"PONG"]


async def test_a_call_not_answered_fails_at_the_deadline_then_reconnects(
    fake: FakeRedis, make: Make
) -> None:
    client = make(fake.url(), command_timeout_s=0.3)
    calls = [client.send([["PING"]]) for _ in range(3)]
    await asyncio.wait_for(fake.wait_received(b"PING", 3), 5)
    for call in calls:
        with pytest.raises(RedisTimeoutError, match=r"did not answer within 0\.3 s"):
            await asyncio.wait_for(call, 5)
    await asyncio.wait_for(fake.closed_by_client.wait(), 5)  # the stalled link is dropped
    again = client.send([["PING"]])
    await asyncio.wait_for(fake.wait_received(b"PING", 4), 5)
    assert fake.connections == 2
    fake.answer()
    assert await asyncio.wait_for(again, 5) == [b"PONG"]


@pytest.mark.slow
async def test_an_answer_before_the_deadline_is_not_a_timeout(fake: FakeRedis, make: Make) -> None:
    # Redis busy, not stalled: each call is answered within its own deadline, though the
    # second one's answer comes after the first one's deadline (when the timer fires).
    client = make(fake.url(), command_timeout_s=1.0)
    first = client.send([["PING"]])
    await asyncio.wait_for(fake.wait_received(b"PING", 1), 5)
    await asyncio.sleep(0.6)  # time passing is the subject here, not a synchronisation
    second = client.send([["PING"]])
    await asyncio.wait_for(fake.wait_received(b"PING", 2), 5)
    fake.answer()
    assert await asyncio.wait_for(first, 5) == [b"PONG"]
    await asyncio.sleep(0.6)  # past the first call's deadline, within the second's
    fake.answer()
    assert await asyncio.wait_for(second, 5) == [b"PONG"]
    assert fake.connections == 1
    assert not fake.closed_by_client.is_set()


@pytest.mark.parametrize("setup", [b"SELECT", b"AUTH"])
async def test_a_setup_never_answered_fails_within_the_connect_timeout(
    fake: FakeRedis, make: Make, setup: bytes
) -> None:
    # A stalled Redis completes the TCP handshake (its kernel does) and answers nothing.
    url = fake.url(3) if setup == b"SELECT" else fake.url().replace("//", "//:secret@")
    client = make(url, connect_timeout_s=0.3, command_timeout_s=30)
    # Never written: nothing for the caller to undo (a NotSent, among connection errors).
    with pytest.raises(NotSent, match="connecting to Redis timed out"):
        await asyncio.wait_for(client.send([["PING"]]), 5)
    assert setup in fake.received
    await asyncio.wait_for(fake.closed_by_client.wait(), 5)  # no half-set-up socket left


async def test_past_max_pending_a_call_fails_at_once_and_is_not_written(
    fake: FakeRedis, make: Make
) -> None:
    client = make(fake.url(), command_timeout_s=30, max_pending=3)
    waiting = [client.send([["PING"]]) for _ in range(3)]
    await asyncio.wait_for(fake.wait_received(b"PING", 3), 5)
    refused = client.send([["ECHO", "refused"]])
    assert refused.done()
    with pytest.raises(NotSent, match="too many calls waiting for Redis"):
        await refused
    fake.answer()
    assert await asyncio.wait_for(waiting[0], 5) == [b"PONG"]
    later = client.send([["ECHO", "later"]])  # room again: written after what came before
    await asyncio.wait_for(fake.wait_received(b"later"), 5)
    assert b"refused" not in fake.received
    assert not later.done()


async def test_past_the_write_buffer_cap_a_call_fails_at_once(fake: FakeRedis, make: Make) -> None:
    client = make(fake.url(), command_timeout_s=30, max_buffer_bytes=1024)
    first = client.send([["PING"]])
    await asyncio.wait_for(fake.wait_received(b"PING"), 5)  # connected
    big = client.send([["ECHO", "x" * 2048]])  # first in its tick: goes
    over = client.send([["ECHO", "over"]])  # same tick, 2 KiB unsent ahead of it
    assert over.done()
    with pytest.raises(RedisConnectionError, match="too many calls waiting for Redis"):
        await over
    await asyncio.wait_for(fake.wait_received(b"x" * 2048), 5)
    assert b"over" not in fake.received
    assert not first.done() and not big.done()


async def test_the_connection_has_tcp_keepalive(fake: FakeRedis, make: Make) -> None:
    client = make(fake.url(), command_timeout_s=30)
    client.send([["PING"]])
    await asyncio.wait_for(fake.wait_received(b"PING"), 5)
    protocol = client._protocol
    assert protocol is not None and protocol._transport is not None
    sock = protocol._transport.get_extra_info("socket")
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0
    if hasattr(socket, "TCP_KEEPIDLE"):
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10


async def test_a_refused_password_is_answered_at_once_without_connecting_again(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path, extra=["--requirepass", "right"]).start()
    client = RespClient(server.url.replace("//", "//:wrong@"))
    admin = RespClient(server.url.replace("//", "//:right@"))
    try:

        async def connections() -> int:
            (info,) = await admin.send([["INFO", "stats"]])
            return int(info.split(b"total_connections_received:")[1].split(b"\r\n")[0])

        before = await connections()
        for _ in range(20):  # a burst of requests meeting a wrong password
            with pytest.raises(NotSent, match=r"^WRONGPASS"):
                await client.send([["PING"]])
        # One refused setup, then its answer for REFUSED_HOLD_S (the loop takes milliseconds).
        assert await connections() - before <= 2
    finally:
        await client.aclose()
        await admin.aclose()
        server.stop()


@pytest.mark.parametrize("form", ["query", "unix"])
async def test_the_lean_client_reaches_the_database_redis_py_does(
    form: str, tmp_path: Path
) -> None:
    """A `?db=` query (the only way a unix socket names its database) is read as redis-py
    reads it: admission and the rest of the gateway never split across two databases."""
    import redis.asyncio as aioredis

    sock = tmp_path / "redis.sock"
    server = RedisServer(tmp_path, extra=["--unixsocket", str(sock)]).start()
    try:
        base = f"unix://{sock}" if form == "unix" else f"redis://127.0.0.1:{server.port}/"
        url = f"{base}?db=5"
        lean = RespClient(url)
        try:
            assert (await lean.send([("SET", "where", form)]))[0] == b"OK"
        finally:
            await lean.aclose()
        other = aioredis.Redis.from_url(url)
        try:
            assert await other.get("where") == form.encode()
        finally:
            await other.aclose()
        db0 = aioredis.Redis(port=server.port, db=0)
        try:
            assert await db0.dbsize() == 0
        finally:
            await db0.aclose()
    finally:
        server.stop()
