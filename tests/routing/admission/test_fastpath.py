"""The scripts' cheap common case (routing/store/lua/acquire.lua, release.lua): an acquire with
room and nobody queued, and a release that leaves nobody queued, skip the reclaim of
expired leases and the pump. Expired leases then never turn a request away, and both still
run when Redis is full."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from routing.admission.slots import GRANTED, QUEUED
from tests.redis_server import RedisServer
from tests.routing.admission.test_slots import A, B, Model, slots
from tiers.policy import Tier


async def test_a_full_model_reclaims_expired_leases_before_turning_a_request_away(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots())
    first = (await m.acquire("l1")).endpoint
    await m.acquire("l2")
    await m.expire_lease("l1")
    got = await m.acquire("l3")
    assert (got.status, got.endpoint) == (GRANTED, first)
    assert await m.leases() == {"l2", "l3"}
    assert await m.load() == {A: 1, B: 1}
    assert (await m.state())[-1] == 1  # the expired lease counts as freed


async def test_an_affinity_request_to_a_full_endpoint_goes_to_another(
    real_redis: aioredis.Redis,
) -> None:
    # The model has room; only the endpoint the request prefers looks full (its lease
    # expired): affinity's load is bounded, the request takes the least loaded other.
    m = Model(real_redis, slots([(A, 1), (B, 2)]))
    assert (await m.acquire("l1", affinity=[A])).endpoint == A
    await m.expire_lease("l1")
    got = await m.acquire("l2", affinity=[A])
    assert (got.status, got.endpoint) == (GRANTED, B)
    await m.sweep()  # the expired lease reclaimed: A has room again
    assert (await m.acquire("l3", affinity=[A])).endpoint == A
    assert await m.leases() == {"l2", "l3"}
    assert await m.load() == {A: 1, B: 1}


async def test_a_release_without_waiters_leaves_expired_leases_to_the_sweep(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    await m.expire_lease("l1")
    assert await m.release("l2") == 0
    assert await m.leases() == {"l1"}
    assert await m.state() == [0, 0, 0, 0, 2]  # the sweep reclaims it
    assert await m.load() == {A: 0, B: 0}


async def test_the_cheap_paths_run_while_redis_is_full(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, maxmemory="2mb").start()
    client = aioredis.Redis.from_url(server.url)
    try:
        m = Model(client, slots())
        await m.acquire("first")  # the model's state, before Redis fills up
        assert await m.release("first") == 0
        await client.eval(
            "redis.call('DEL', 'filler:none') "
            "for i = 1, 300 do redis.call('SET', 'filler:' .. i, string.rep('x', 10000)) end",
            0,
        )
        with pytest.raises(ResponseError, match="maxmemory"):
            await client.set("probe", "x")
        got = await m.acquire("l1")
        assert got.status == GRANTED
        assert await m.release("l1") == 0
        assert await m.leases() == set()
    finally:
        await client.aclose()
        server.stop()


async def test_a_worse_tiers_waiters_do_not_stop_the_reclaim_before_a_refusal(
    real_redis: aioredis.Redis,
) -> None:
    """Only flex waits, held back by its ceiling: a default request that may not wait, finding
    the model full only because of a dead replica's lease, still reclaims it and is served
    (a waiter of its own tier or a better one would go first: then the sweeps reclaim)."""
    m = Model(real_redis, slots([(A, 5)], flex=0.8))
    for i in range(4):
        assert (await m.acquire(f"l{i}")).status == GRANTED
    assert (await m.acquire("f", Tier.FLEX, may_wait=True)).status == QUEUED  # at its ceiling
    assert (await m.acquire("l4")).status == GRANTED
    await m.expire_lease("l0")
    assert (await m.acquire("d")).status == GRANTED
    assert await m.queue() == ["f"]
    assert "l0" not in await m.leases()


@pytest.mark.usefixtures("script_modes")
async def test_a_better_tiers_waiters_held_by_its_ceiling_do_not_stop_the_reclaim(
    real_redis: aioredis.Redis,
) -> None:
    """Priority's ceiling set below default's: priority waits, held back by it. A default
    request that may not wait, finding the model full only because of a dead replica's
    lease, still reclaims it and is served (the priority waiter could not take the slot)."""
    m = Model(real_redis, slots([(A, 5)], priority=0.4))  # priority's ceiling: 2
    for i in range(2):
        assert (await m.acquire(f"p{i}", Tier.PRIORITY)).status == GRANTED
    assert (await m.acquire("pw", Tier.PRIORITY, may_wait=True)).status == QUEUED
    for i in range(2, 5):
        assert (await m.acquire(f"l{i}")).status == GRANTED
    await m.expire_lease("l2")
    assert (await m.acquire("d")).status == GRANTED
    assert await m.queue() == ["pw"]
    assert "l2" not in await m.leases()


@pytest.mark.usefixtures("script_modes")
async def test_what_the_reclaim_lets_under_a_better_tiers_ceiling_goes_to_its_waiter_first(
    real_redis: aioredis.Redis,
) -> None:
    """As above, but the reclaim brings the model under priority's ceiling: its waiter takes a
    slot before the default newcomer does (which would otherwise hold it at its ceiling)."""
    m = Model(real_redis, slots([(A, 5)], priority=0.4))  # priority's ceiling: 2
    assert (await m.acquire("p0", Tier.PRIORITY)).status == GRANTED
    for i in range(1, 5):
        assert (await m.acquire(f"l{i}")).status == GRANTED
    assert (await m.acquire("pw", Tier.PRIORITY, may_wait=True)).status == QUEUED
    for i in range(1, 5):
        await m.expire_lease(f"l{i}")
    assert (await m.acquire("d")).status == GRANTED
    assert await m.queue() == []
    assert await m.leases() == {"p0", "pw", "d"}
