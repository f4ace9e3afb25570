"""Shared fixtures: the run's own redis-server (started here, on a free port) and factories.

The tests never touch a Redis they did not start: `pytest_configure` starts one for the
whole run and `REDIS_URL` points at it (db 15, so the client's SELECT path is exercised too);
fault tests start more (tests/redis_server.py).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.redis_cluster import RedisCluster, start_cluster
from tests.redis_server import RedisServer

# Set by pytest_configure, before any test module is imported.
REDIS_URL = ""
_SERVER: RedisServer | None = None
_SERVER_DIR: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    global REDIS_URL, _SERVER, _SERVER_DIR
    _SERVER_DIR = Path(tempfile.mkdtemp(prefix="gateway-tests-redis-"))
    _SERVER = RedisServer(_SERVER_DIR).start()
    REDIS_URL = f"redis://127.0.0.1:{_SERVER.port}/15"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test on the run's Redis Cluster is slow (`make check` leaves it out): the first to ask
    starts three masters and waits for their slot map. (The other slow tests say so.)"""
    for item in items:
        if "redis_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SERVER is not None:
        _SERVER.stop()
    if _SERVER_DIR is not None:
        shutil.rmtree(_SERVER_DIR, ignore_errors=True)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test alone, to stall, kill or restart at will."""
    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()  # resumes it first if paused


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A 3-master Redis Cluster of this run, started by the first test that asks for it."""
    cluster = start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def empty_cluster(redis_cluster: RedisCluster) -> Iterator[RedisCluster]:
    """The run's cluster, emptied (keys and scripts) before and after the test."""
    redis_cluster.flush()
    try:
        yield redis_cluster
    finally:
        redis_cluster.flush()


@pytest.fixture
async def real_redis() -> AsyncIterator[aioredis.Redis]:
    """The run's Redis, emptied of gateway keys before and after the test."""
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
    """The run's Redis with the stream `usage` and the usage dedupe keys removed before and
    after."""
    await _forget_usage(real_redis)
    try:
        yield real_redis
    finally:
        await _forget_usage(real_redis)


async def _forget_usage(client: aioredis.Redis) -> None:
    keys = [k async for k in client.scan_iter(match="{usage}:rid*", count=1000)]
    await client.delete("usage", *keys)
