"""A replica that closes leaves no connection open to Redis: its scripts' client (the lean
one or redis-py), its keeper's subscription and its usage records all let go, as Redis
itself counts them (not the garbage collector's warnings, which fire in whichever test runs
when it does)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from gateway.runtime.settings import parse_config
from routing.admission.admit import Admission
from routing.admission.keeper import Keeper
from routing.admission.plan import plan_candidates
from routing.registry import Registry
from routing.store.base import Store
from routing.store.connect import RedisPyStore
from routing.store.resp import RespClient
from tests.factories import usage_record
from tests.redis_server import RedisServer

CONFIG = """
redis: {url: "redis://unused"}
models:
  m: {endpoints: [{url: "http://m-a:8000", max_concurrency: 2}]}
"""
BOUND_S = 5.0
REQUESTS = 4


def connections(server: RedisServer) -> int:
    """Clients Redis holds besides the one asking."""
    with redis.Redis(port=server.port) as client:
        return len(client.client_list()) - 1


def settled(server: RedisServer, want: int) -> int:
    """Clients Redis holds once it has read the closes sent to it (it notices a closed
    socket on its next event-loop turn; there is no event to wait on across processes)."""
    deadline = time.monotonic() + BOUND_S
    while (held := connections(server)) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return held


@pytest.mark.parametrize("lean", [True, False], ids=["resp", "redis-py"])
async def test_a_closed_replica_leaves_no_connection_to_redis(tmp_path: Path, lean: bool) -> None:
    server = RedisServer(tmp_path).start()
    clients: list[aioredis.Redis] = []
    try:
        config = parse_config(CONFIG, "closing.yaml")
        registry = Registry(config.models)
        url = server.url
        if not lean:
            clients.append(aioredis.Redis.from_url(url))
        store: Store = RespClient(url) if lean else RedisPyStore(clients[0], 2.0)
        adm = Admission(store, registry, config.tiers, lease_ttl_s=30, on_outage="reject")
        await asyncio.wait_for(adm.start(), BOUND_S)
        clients.append(aioredis.Redis.from_url(url, socket_timeout=None))
        keeper = Keeper(adm, clients[-1], interval_s=0.05)
        await keeper.start()
        plan = plan_candidates("m", None, fail_fast=False, registry=registry, allowed=None)
        for i in range(REQUESTS):
            admitted = await asyncio.wait_for(adm.admit(plan, "acme", 10), BOUND_S)
            fields = usage_record(request_id=f"closing-{i}").to_fields()
            await asyncio.wait_for(adm.release(admitted.lease, fields), BOUND_S)
        assert await asyncio.to_thread(connections, server) > 0  # the replica was connected
        await asyncio.wait_for(keeper.close(), BOUND_S)
        await asyncio.wait_for(adm.close(), BOUND_S)
        await store.aclose()
        for client in clients:
            await client.aclose()
        assert await asyncio.to_thread(settled, server, 0) == 0
        with redis.Redis(port=server.port) as check:
            assert check.xlen("usage") == REQUESTS  # every record went before the close
    finally:
        server.stop()
