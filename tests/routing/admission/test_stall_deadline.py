"""A queued request whose deadline (x-request-timeout) falls inside a Redis stall: its cancel
meets the stall and fails at the command timeout, after the deadline. It is answered as
its deadline says (429 `deadline_unreachable`, docs/api.md), in both outage modes: never
admitted on the local share after the time its caller said it would wait (that request
would reach a worker its caller has given up on, and be billed), nor a 503. What it left
in Redis is forgotten afterwards. On a Redis of the test's own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.runtime.settings import parse_config
from routing.admission.admit import Admission
from routing.admission.holdings import FORGET_ROUNDS
from routing.admission.keeper import Keeper
from routing.errors import Limited, LimitReason
from routing.registry import Registry
from routing.store.resp import RespClient
from tests.redis_server import RedisServer
from tests.routing.admission.test_admission import watch_queued
from tests.routing.admission.test_stall import COMMAND_TIMEOUT_S, CONFIG, plan

DEADLINE_S = 0.3  # well inside the tier's queue timeout


def replica(server: RedisServer, on_outage: str) -> tuple[Admission, RespClient]:
    config = parse_config(CONFIG, "stall.yaml")
    store = RespClient(server.url, command_timeout_s=COMMAND_TIMEOUT_S)
    adm = Admission(
        store, Registry(config.models), config.tiers, lease_ttl_s=30, on_outage=on_outage,
        sweep_interval_s=0.25, command_timeout_s=COMMAND_TIMEOUT_S,
    )  # fmt: skip
    return adm, store


@pytest.fixture(params=["reject", "local"])
async def two(
    tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[RedisServer, Admission, Admission, Keeper]]:
    """Replica `a` (the mode under test, its keeper) and `b`, which takes the one slot."""
    server = RedisServer(tmp_path).start()
    (a, store_a), (b, store_b) = replica(server, request.param), replica(server, "reject")
    await a.start()
    await b.start()
    keeper = Keeper(a, aioredis.Redis.from_url(server.url), interval_s=0.25)
    try:
        yield server, a, b, keeper
    finally:
        server.resume()
        await keeper.close()
        for adm, store in ((a, store_a), (b, store_b)):
            await adm.close()
            await store.aclose()
        server.stop()


async def test_a_waiter_whose_deadline_passes_in_a_stall_leaves_for_its_deadline(
    two: tuple[RedisServer, Admission, Admission, Keeper],
) -> None:
    server, a, b, keeper = two
    await asyncio.wait_for(keeper.sweep_once(), 5)  # a's view: the fleet holds nothing
    held = await asyncio.wait_for(b.admit(plan(), "other", 10), 5)  # the only slot, b's
    queued = watch_queued(a)
    waiter = asyncio.create_task(a.admit(plan(), "acct", 10, deadline_s=DEADLINE_S))
    await asyncio.wait_for(queued.get(), 5)
    server.pause()
    try:
        with pytest.raises(Limited) as refused:
            admitted = await asyncio.wait_for(waiter, 10)
            a.release(admitted.lease)  # (the failure: admitted past its deadline)
    finally:
        server.resume()
    assert refused.value.reason is LimitReason.DEADLINE_UNREACHABLE
    assert refused.value.model == "m" and refused.value.retry_after_s >= 1
    assert not a.held
    await asyncio.wait_for(b.release(held.lease), 5)
    for _ in range(FORGET_ROUNDS):  # whatever the failed cancel left is forgotten
        await asyncio.wait_for(keeper.sweep_once(), 5)
    client = aioredis.Redis.from_url(server.url)
    try:
        assert await client.zcard("gw:v2:{m}:queue") == 0
        assert await client.zcard("gw:v2:{m}:leases") == 0
    finally:
        await client.aclose()
