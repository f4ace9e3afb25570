"""The redis-py clients: calls bounded by the command timeout, keepalive on, pub/sub unbounded."""

from __future__ import annotations

import socket

from routing.resp import RespClient
from routing.store import connect, script_store, subscriber
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
