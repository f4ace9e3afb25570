"""The lean pipelining Redis client of the admission hot path, against the real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from routing.resp import RespClient, pack
from tests.conftest import REDIS_URL


@pytest.fixture
async def client() -> AsyncIterator[RespClient]:
    made = RespClient(REDIS_URL)
    yield made
    await made.aclose()


def test_pack_is_resp() -> None:
    assert pack([["SET", "k", 1.5], [b"GET", "k"]]) == (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\n1.5\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
    )


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


async def test_a_stalled_call_is_failed_by_fail_stalled() -> None:
    got_request = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.read(1 << 16)  # swallow the request, never answer
        got_request.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    stalled = RespClient(f"redis://127.0.0.1:{port}/0")
    try:
        call = stalled.send([["PING"]])
        await asyncio.wait_for(got_request.wait(), 5)
        assert not stalled.fail_stalled(60.0)
        assert stalled.fail_stalled(0.0)
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(call, 5)
    finally:
        await stalled.aclose()
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_nothing_listening_is_a_connection_error() -> None:
    dead = RespClient("redis://127.0.0.1:1/0", connect_timeout_s=0.5)
    with pytest.raises(RedisConnectionError):
        await dead.send([["PING"]])
