"""Shared fixtures: the real Redis (REDIS_URL, default db 15) and small factories."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture
async def real_redis() -> AsyncIterator[aioredis.Redis]:
    """The real Redis server, emptied of gateway keys before and after the test."""
    client = aioredis.Redis.from_url(REDIS_URL)
    await _clear(client)
    try:
        yield client
    finally:
        await _clear(client)
        await client.aclose()


async def _clear(client: aioredis.Redis) -> None:
    keys = [k async for k in client.scan_iter(match="gw:*", count=1000)]
    if keys:
        await client.delete(*keys)


@pytest.fixture
async def usage_redis(real_redis: aioredis.Redis) -> AsyncIterator[aioredis.Redis]:
    """The real Redis with the stream `usage` and the tests' dedupe keys ("t-" request
    ids) removed before and after."""
    await _forget_usage(real_redis)
    try:
        yield real_redis
    finally:
        await _forget_usage(real_redis)


async def _forget_usage(client: aioredis.Redis) -> None:
    keys = [k async for k in client.scan_iter(match="{usage}:rid:t-*", count=1000)]
    await client.delete("usage", *keys)
