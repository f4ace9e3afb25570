"""The redis-py clients: calls bounded by the command timeout, keepalive on, pub/sub unbounded;
the `Store` interface, over the lean client and over redis-py alike."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.exceptions import DataError, ResponseError

from routing.store.base import Store
from routing.store.connect import (
    MAX_CONNECTIONS,
    RedisPyStore,
    call_timeout,
    connect,
    script_store,
    subscriber,
)
from routing.store.keys import account_key
from routing.store.resp import RespClient
from routing.store.scripts import Scripts
from tests.conftest import REDIS_URL


async def test_the_client_gives_up_after_the_command_timeout_and_keeps_alive() -> None:
    client = connect(REDIS_URL, command_timeout_s=0.7)
    try:
        options = client.connection_pool.connection_kwargs
        assert options["socket_timeout"] == 0.7
        assert options["socket_keepalive"] is True
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert options["socket_keepalive_options"][socket.TCP_KEEPIDLE] == 10
        assert await client.ping()  # the platform accepts these socket options
    finally:
        await client.aclose()


async def test_the_subscriber_has_no_socket_timeout_but_keeps_alive() -> None:
    client = connect(REDIS_URL, command_timeout_s=0.7)
    listener = subscriber(REDIS_URL, client)
    try:
        options = listener.connection_pool.connection_kwargs
        assert options["socket_timeout"] is None  # a quiet channel is not an error
        assert options["socket_keepalive"] is True
        assert await listener.ping()
    finally:
        await listener.aclose()
        await client.aclose()


async def test_the_script_store_gets_the_command_timeout() -> None:
    client = connect(REDIS_URL, command_timeout_s=0.7)
    store = script_store(REDIS_URL, client, 0.7)
    try:
        assert isinstance(store, RespClient)
        assert store._timeout == 0.7
        memory = script_store("memory://", client, 0.7)
        assert isinstance(memory, RedisPyStore)
        assert (memory.client, memory.timeout_s) == (client, None)
        tls = script_store("rediss://127.0.0.1:1/0", client, 0.7)
        assert isinstance(tls, RedisPyStore)
        assert (tls.client, tls.timeout_s) == (client, 0.7)
    finally:
        await store.aclose()
        await client.aclose()


async def test_memory_store_takes_any_number_of_calls_at_once_without_a_deadline() -> None:
    """memory:// (the demo) lives in this process: redis-py's default pool refused the
    101st concurrent call, and a burst queued longer than the command timeout on the CPU."""
    client = connect("memory://", command_timeout_s=0.7)

    async def batch(i: int) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        pipe.set(f"k{i}", i)
        pipe.get(f"k{i}")
        return list(await pipe.execute())

    try:
        replies = await asyncio.gather(*(batch(i) for i in range(500)))
    finally:
        await client.aclose()
    assert replies == [[True, str(i).encode()] for i in range(500)]
    assert call_timeout("memory://", 0.7) is None
    assert call_timeout(REDIS_URL, 0.7) == 0.7


async def test_a_redis_py_call_waits_for_a_free_connection_within_the_timeout() -> None:
    client = connect(REDIS_URL, command_timeout_s=0.7)
    try:
        pool = client.connection_pool
        assert isinstance(pool, BlockingConnectionPool)
        assert (pool.max_connections, pool.timeout) == (MAX_CONNECTIONS, 0.7)
    finally:
        await client.aclose()


# --- the Store interface: the lean client and redis-py answer alike ---------------------------


async def bounded(awaitable: Any) -> Any:
    return await asyncio.wait_for(awaitable, 5)


@pytest.fixture(params=["resp", "redis-py", "memory"])
async def store_and_admin(
    request: pytest.FixtureRequest, real_redis: aioredis.Redis
) -> AsyncIterator[tuple[Store, aioredis.Redis]]:
    """A Store of each kind, with a redis-py client on the same data (to set up, to flush
    the scripts): the run's redis-server for the lean client and redis-py, fakeredis for
    memory://."""
    admin = connect("memory://", command_timeout_s=2.0) if request.param == "memory" else real_redis
    store: Store = (
        RespClient(REDIS_URL)
        if request.param == "resp"
        else RedisPyStore(admin, None if request.param == "memory" else 2.0)
    )
    try:
        yield store, admin
    finally:
        await store.aclose()
        if admin is not real_redis:
            await admin.aclose()


async def test_a_batch_answers_an_error_reply_in_its_place(
    store_and_admin: tuple[Store, aioredis.Redis],
) -> None:
    store, _ = store_and_admin
    key = "gw:t-store:list"
    replies = await bounded(store.send([("RPUSH", key, "a"), ("INCR", key), ("LLEN", key)]))
    assert replies[0] == 1
    assert isinstance(replies[1], ResponseError)  # WRONGTYPE: the others ran all the same
    assert replies[2] == 1


async def test_an_argument_that_cannot_be_encoded_is_a_data_error(
    store_and_admin: tuple[Store, aioredis.Redis],
) -> None:
    store, _ = store_and_admin
    key = "gw:t-store:unsent"
    with pytest.raises(DataError):
        await bounded(store.send([("RPUSH", key, "a"), ("RPUSH", key, "\ud800")]))
    # Nothing of the batch was sent, and the store still serves the next one.
    assert await bounded(store.send([("LLEN", key)])) == [0]


async def test_scripts_resend_only_the_calls_that_got_noscript(
    store_and_admin: tuple[Store, aioredis.Redis],
) -> None:
    """Redis lost its scripts: they are loaded again through the store, and only the script
    call is resent (the plain command ran in the first round trip)."""
    store, admin = store_and_admin
    scripts = Scripts()
    await bounded(scripts.load(store))
    await admin.script_flush()
    await admin.function_flush()  # Redis restarted empty: both gone
    key = account_key("t-store")
    replies = await bounded(
        scripts.send(store, [("account", [key], ["l1", 5, 30_000]), ("ZCARD", [key], [])])
    )
    assert replies == [1, 0]  # ZCARD ran before the account call got through, not after
    assert await admin.zcard(key) == 1  # counted once
    assert all(await admin.script_exists(*scripts.loaded.values()))
    if scripts.functions:  # loaded again too (the memory store's emulation may lack them)
        listed = await admin.function_list()
        libraries = [dict(zip(lib[::2], lib[1::2], strict=True)) for lib in listed]
        assert [lib[b"library_name"] for lib in libraries] == [scripts.library.encode()]
    assert await bounded(scripts.call(store, ("ZCARD", [key], []))) == 1
    await admin.delete(key)


async def test_the_scripts_run_as_one_library_of_functions_where_redis_has_them(
    store_and_admin: tuple[Store, aioredis.Redis],
) -> None:
    """Redis 7 takes the library (every script a function of it) and the calls go by FCALL;
    a second load, by another replica of the same release, finds it there and uses it."""
    store, admin = store_and_admin
    first, second = Scripts(), Scripts()
    await bounded(first.load(store))
    await bounded(second.load(store))
    assert first.library == second.library
    assert set(second.functions) == {
        "acquire", "release", "account", "cancel", "sweep", "move", "index", "start"
    }  # fmt: skip
    key = account_key("t-lib")
    assert await bounded(second.call(store, ("account", [key], ["l1", 5, 30_000]))) == 1
    assert await admin.zcard(key) == 1
    await admin.delete(key)


async def test_without_function_load_the_same_scripts_run_by_evalsha(
    store_and_admin: tuple[Store, aioredis.Redis],
) -> None:
    """A Redis that refuses the library (6.2; an ACL without FUNCTION): no function is
    used, and the scripts do the same by EVALSHA."""
    store, admin = store_and_admin
    scripts = Scripts(functions=False)
    await bounded(scripts.load(store))
    assert scripts.functions == {}
    key = account_key("t-eval")
    assert await bounded(scripts.call(store, ("account", [key], ["l1", 5, 30_000]))) == 1
    assert await admin.zcard(key) == 1
    await admin.delete(key)
