"""The admission scripts (SPEC 4) at the Redis level: grants, ceilings, queue order, sweep."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis

from routing.slots import (
    BUSY,
    FULL,
    GRANTED,
    QUEUED,
    Attempt,
    ModelSlots,
    Scripts,
    account_key,
    attempt,
    text,
)
from tiers.policy import Tier

A, B = "http://a:8000", "http://b:8000"
TTL_MS = 30_000
WAIT_MS = 30_000


def slots(
    endpoints: Sequence[tuple[str, int]] = ((A, 1), (B, 1)),
    *,
    max_queue: int = 10,
    flex: float = 0.8,
    model: str = "m",
) -> ModelSlots:
    utilization = {Tier.PRIORITY: 1.0, Tier.DEFAULT: 1.0, Tier.FLEX: flex}
    made = ModelSlots(model, utilization, max_queue, TTL_MS)
    made.set_endpoints([(url, size, 0.0) for url, size in endpoints])
    return made


class Model:
    """A ModelSlots and the scripts, bound to one client: each method is one script call."""

    def __init__(self, client: aioredis.Redis, model: ModelSlots) -> None:
        self.client = client
        self.slots = model
        self.scripts = Scripts()

    async def run(self, call: Any) -> Any:
        return await asyncio.wait_for(self.scripts.run(self.client, call), 5)

    async def acquire(
        self,
        lease_id: str,
        tier: Tier = Tier.DEFAULT,
        *,
        may_wait: bool = False,
        affinity: Sequence[str] | None = None,
    ) -> Attempt:
        call = self.slots.acquire(
            lease_id, tier, may_wait=may_wait, wait_ms=WAIT_MS, affinity=affinity
        )
        return attempt(await self.run(call))

    async def release(self, lease_id: str) -> int:
        return int(await self.run(self.slots.release(lease_id)))

    async def cancel(self, waiter_id: str) -> str:
        return text(await self.run(self.slots.cancel(waiter_id)))

    async def sweep(self) -> list[int]:
        return [int(v) for v in await self.run(self.slots.sweep())]

    async def leases(self) -> set[str]:
        return {text(m) for m in await self.client.zrange(self.slots.keys[0], 0, -1)}

    async def queue(self) -> list[str]:
        return [text(m) for m in await self.client.zrange(self.slots.keys[1], 0, -1)]

    async def load(self) -> dict[str, int]:
        raw = await self.client.hgetall(self.slots.keys[3])
        return {text(k): int(v) for k, v in raw.items()}

    async def expire_lease(self, lease_id: str) -> None:
        """Push a lease's expiry into the past, as if its holder had died."""
        assert await self.client.zadd(self.slots.keys[0], {lease_id: 1}, xx=True, ch=True) == 1


async def next_message(pubsub: Any) -> str:
    """The next published message's data (subscribe confirmations skipped)."""

    async def read() -> str:
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None:
                return text(message["data"])

    return await asyncio.wait_for(read(), 5)


@pytest.fixture(params=["real", "fake"])
async def any_redis(
    request: pytest.FixtureRequest, real_redis: aioredis.Redis
) -> AsyncIterator[aioredis.Redis]:
    """The real Redis, and fakeredis (the `memory://` mode runs the same scripts)."""
    if request.param == "real":
        yield real_redis
        return
    client: Any = fakeredis.FakeAsyncRedis()
    try:
        yield client
    finally:
        await client.aclose()


async def test_smoke_grant_busy_queue_release(any_redis: aioredis.Redis) -> None:
    m = Model(any_redis, slots())
    assert (await m.acquire("l1")).status == GRANTED
    assert (await m.acquire("l2")).status == GRANTED
    busy = await m.acquire("l3")
    assert (busy.status, busy.endpoint, busy.inflight, busy.ahead) == (BUSY, "", 2, 0)
    queued = await m.acquire("w1", may_wait=True)
    assert (queued.status, queued.inflight, queued.ahead) == (QUEUED, 2, 0)
    assert await m.queue() == ["w1"]
    assert await m.release("l1") == 1  # handed on to the waiter
    assert await m.leases() == {"l2", "w1"}
    assert await m.queue() == []
    assert await m.release("l2") == 0
    assert await m.release("w1") == 0
    assert await m.leases() == set()
    assert await m.load() == {A: 0, B: 0}


async def test_grants_until_capacity_then_busy(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    first, second = await m.acquire("l1"), await m.acquire("l2")
    assert (first.status, first.inflight) == (GRANTED, 1)
    assert (second.status, second.inflight) == (GRANTED, 2)
    assert {first.endpoint, second.endpoint} == {A, B}
    for tier in Tier:
        assert (await m.acquire(f"late-{tier}", tier)).status == BUSY
    assert await m.leases() == {"l1", "l2"}
    assert await m.queue() == []


async def test_flex_only_takes_spare_capacity(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots([(A, 5)]))  # flex ceiling 5 x 0.8 = 4
    for i in range(4):
        assert (await m.acquire(f"f{i}", Tier.FLEX)).status == GRANTED
    fifth = await m.acquire("f4", Tier.FLEX)
    assert (fifth.status, fifth.inflight) == (BUSY, 4)
    assert (await m.acquire("d", Tier.DEFAULT)).status == GRANTED
    assert (await m.acquire("p", Tier.PRIORITY)).status == BUSY


async def test_least_loaded_endpoint_relative_to_size(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots([(A, 2), (B, 4)]))
    picked = [(await m.acquire(f"l{i}")).endpoint for i in range(3)]
    # Whoever wins the 0/2 vs 0/4 tie, the next two go where the relative load is lower.
    assert sorted(picked) == [A, B, B]
    picked += [(await m.acquire(f"l{i}")).endpoint for i in range(3, 6)]
    assert sorted(picked) == [A, A, B, B, B, B]
    assert await m.load() == {A: 2, B: 4}
    assert (await m.acquire("l6")).status == BUSY


async def test_first_mode_takes_first_affinity_endpoint_with_room(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots([(A, 2), (B, 2)]))
    picked = [(await m.acquire(f"l{i}", affinity=[B, A])).endpoint for i in range(4)]
    assert picked == [B, B, A, A]
    assert (await m.acquire("l4", affinity=[B, A])).status == BUSY


async def test_affinity_restricted_to_a_full_endpoint_is_busy(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    assert (await m.acquire("l1", affinity=[A])).endpoint == A
    assert (await m.acquire("l2", affinity=[A])).status == BUSY
    assert (await m.acquire("l3")).endpoint == B


async def test_queue_order_by_tier_then_arrival_and_grants_published(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots())
    pubsub: Any = real_redis.pubsub()
    await pubsub.subscribe(m.slots.channel)
    try:
        first, second = (await m.acquire("l1")).endpoint, (await m.acquire("l2")).endpoint
        assert {first, second} == {A, B}
        a = await m.acquire("A", Tier.DEFAULT, may_wait=True)
        b = await m.acquire("B", Tier.PRIORITY, may_wait=True)
        c = await m.acquire("C", Tier.DEFAULT, may_wait=True)
        assert [(r.status, r.ahead) for r in (a, b, c)] == [(QUEUED, 0), (QUEUED, 0), (QUEUED, 2)]
        assert await m.queue() == ["B", "A", "C"]

        assert await m.release("l1") == 1
        assert await next_message(pubsub) == f"B {first}"
        assert await m.release("l2") == 1
        assert await next_message(pubsub) == f"A {second}"
        assert await m.release("B") == 1
        assert await next_message(pubsub) == f"C {first}"
        assert await m.queue() == []
        assert await m.leases() == {"A", "C"}
    finally:
        await pubsub.aclose()


async def test_newcomer_does_not_jump_a_waiter_when_a_slot_frees(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    assert (await m.acquire("w", Tier.DEFAULT, may_wait=True)).status == QUEUED
    await m.expire_lease("l1")  # a slot is free for whoever runs the next script
    newcomer = await m.acquire("n", Tier.DEFAULT)
    assert newcomer.status == BUSY
    assert await m.leases() == {"l2", "w"}
    assert await m.queue() == []


async def test_newcomer_queues_behind_a_waiter_of_its_own_tier(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    assert (await m.acquire("w1", Tier.PRIORITY, may_wait=True)).status == QUEUED
    assert (await m.acquire("w2", Tier.PRIORITY, may_wait=True)).status == QUEUED
    await m.expire_lease("l1")
    newcomer = await m.acquire("n", Tier.PRIORITY, may_wait=True)
    assert (newcomer.status, newcomer.ahead) == (QUEUED, 1)
    assert await m.queue() == ["w2", "n"]
    assert await m.leases() == {"l2", "w1"}


async def test_better_tier_passes_a_flex_waiter_held_back_by_its_ceiling(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots([(A, 5)]))
    for i in range(4):
        await m.acquire(f"l{i}")
    assert (await m.acquire("flex", Tier.FLEX, may_wait=True)).status == QUEUED
    assert (await m.acquire("d", Tier.DEFAULT)).status == GRANTED
    assert await m.queue() == ["flex"]


async def test_queue_full(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots(max_queue=2))
    await m.acquire("l1")
    await m.acquire("l2")
    assert (await m.acquire("w1", may_wait=True)).status == QUEUED
    assert (await m.acquire("w2", Tier.FLEX, may_wait=True)).status == QUEUED
    full = await m.acquire("w3", Tier.PRIORITY, may_wait=True)
    assert (full.status, full.endpoint, full.ahead) == (FULL, "", 2)
    assert await m.queue() == ["w1", "w2"]


async def test_cancel_queued_then_granted(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    first = (await m.acquire("l1")).endpoint
    await m.acquire("l2")
    await m.acquire("w1", may_wait=True)
    await m.acquire("w2", may_wait=True)
    assert await m.cancel("w1") == ""
    assert await m.queue() == ["w2"]
    assert await real_redis.zcard(m.slots.keys[6]) == 1  # w1 gone from qexp too
    assert await m.release("l1") == 1
    assert await m.cancel("w2") == first  # granted already: the slot is the waiter's
    assert "w2" in await m.leases()
    assert await m.cancel("unknown") == ""
    assert await real_redis.zcard(m.slots.keys[6]) == 0


async def test_sweep_reclaims_expired_leases(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    await m.expire_lease("l1")
    await m.expire_lease("l2")
    assert await m.sweep() == [0, 0, 0, 0, 2]
    assert await m.leases() == set()
    assert await m.load() == {A: 0, B: 0}
    assert await real_redis.hlen(m.slots.keys[2]) == 0


async def test_sweep_hands_reclaimed_slots_to_waiters_and_reports_queues(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    await m.acquire("p", Tier.PRIORITY, may_wait=True)
    await m.acquire("d", Tier.DEFAULT, may_wait=True)
    await m.acquire("f", Tier.FLEX, may_wait=True)
    assert await m.sweep() == [2, 1, 1, 1, 0]
    await m.expire_lease("l1")
    assert await m.sweep() == [2, 0, 1, 1, 1]
    assert await m.leases() == {"l2", "p"}


async def test_sweep_drops_waiters_past_their_give_up_time(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    await m.acquire("gone", may_wait=True)
    await m.acquire("alive", may_wait=True)
    await real_redis.zadd(m.slots.keys[6], {"gone": 1}, xx=True)
    assert await m.sweep() == [2, 0, 1, 0, 0]
    assert await m.queue() == ["alive"]
    assert await m.release("l1") == 1
    assert await m.leases() == {"l2", "alive"}


async def test_refresh_pushes_existing_leases_only(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    await m.acquire("kept")
    await m.acquire("released")
    await m.release("released")
    await m.expire_lease("kept")
    assert int(await m.run(m.slots.refresh(["kept", "released", "never"]))) == 1
    assert (await real_redis.zscore(m.slots.keys[0], "kept") or 0) > 1
    assert await real_redis.zscore(m.slots.keys[0], "released") is None
    assert await m.sweep() == [1, 0, 0, 0, 1]
    assert await m.leases() == {"kept"}


async def test_account_limit(real_redis: aioredis.Redis) -> None:
    scripts = Scripts()
    key = account_key("acme")

    async def take(lease_id: str) -> int:
        return int(await scripts.run(real_redis, ("account", [key], [lease_id, 2, TTL_MS])))

    assert [await take("a1"), await take("a2"), await take("a3")] == [1, 1, 0]
    assert await real_redis.zcard(key) == 2
    await real_redis.zadd(key, {"a1": 1}, xx=True)  # expired: no longer counts
    assert await take("a4") == 1
    assert {text(m) for m in await real_redis.zrange(key, 0, -1)} == {"a2", "a4"}
    assert await take("a5") == 0


async def test_execute_recovers_from_a_flushed_script_cache(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    await m.scripts.load(real_redis)
    await real_redis.script_flush()
    replies = await m.scripts.execute(
        real_redis,
        [
            m.slots.acquire("l1", Tier.DEFAULT, may_wait=False, wait_ms=WAIT_MS),
            ("ZCARD", [m.slots.keys[0]], []),
        ],
    )
    assert attempt(replies[0]).status == GRANTED
    assert int(replies[1]) == 1
    assert all(await real_redis.script_exists(*m.scripts.sha.values()))


async def test_equal_loads_take_turns(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots([(A, 4), (B, 4)]))
    picked = []
    for i in range(6):
        picked.append((await m.acquire(f"t{i}")).endpoint)
        await m.release(f"t{i}")
    assert picked.count(A) == 3 and picked.count(B) == 3
