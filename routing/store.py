"""The connection to the shared store (Redis), or an in-process stand-in for `memory://`."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from routing.resp import RespClient, keepalive_options


def connect(url: str, *, command_timeout_s: float) -> aioredis.Redis:
    """A client for `url` whose calls give up after `command_timeout_s` (a stalled Redis is
    an outage, not a hang); `memory://` gives fakeredis in this process (one replica only)."""
    if url.startswith("memory://"):
        import fakeredis

        client: Any = fakeredis.FakeAsyncRedis()
        return client  # type: ignore[no-any-return]
    return _redis_py(url, socket_timeout=command_timeout_s, max_connections=512)


def script_store(
    url: str, client: aioredis.Redis, command_timeout_s: float
) -> RespClient | aioredis.Redis:
    """Where admission scripts run: the lean pipelining client for redis:// and unix://,
    else (memory://, rediss://) the redis-py `client`."""
    if RespClient.supports(url):
        return RespClient(url, command_timeout_s=command_timeout_s)
    return client


def subscriber(url: str, client: aioredis.Redis) -> aioredis.Redis:
    """A client for the one pub/sub subscription: no socket timeout, so a quiet channel is
    not an error (redis-py #2807); keepalive finds a peer that vanished. memory:// shares
    the in-process server of `client`."""
    if url.startswith("memory://"):
        return client
    return _redis_py(url, socket_timeout=None)


def _redis_py(url: str, *, socket_timeout: float | None, **options: Any) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=2.0,
        socket_timeout=socket_timeout,
        socket_keepalive=True,
        socket_keepalive_options=keepalive_options(),
        health_check_interval=15,
        **options,
    )
