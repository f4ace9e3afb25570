"""The redis-py clients: calls bounded by the command timeout, keepalive on, pub/sub unbounded."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from redis.asyncio.connection import BlockingConnectionPool

from routing.resp import RespClient
from routing.store import MAX_CONNECTIONS, call_timeout, connect, script_store, subscriber
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
        assert script_store("memory://", client, 0.7) is client
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
