"""Fair share inside a tier at the Redis level (docs/config.md, fair share): a freed slot goes
to the waiting account with the fewest of the model's slots per weight, first come first
served within an account; `fifo` tiers keep arrival order; tiers stay strict; cancel, the
sweep's write-back and dead replicas' leases keep the account queues right."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from routing.admission.replies import attempt
from routing.admission.slots import GRANTED, QUEUED, RANK, ModelSlots, make_lease_id
from routing.store.scripts import Scripts
from routing.store.wire import text
from tests.redis_cluster import RedisCluster
from tests.routing.admission.test_slots import TIMING, A, B, Model
from tests.routing.store.test_cluster import lean_store
from tiers.policy import Tier

# Every test here runs on both bindings of the scripts (tests/routing/conftest.py).
pytestmark = pytest.mark.usefixtures("script_modes")

UTILIZATION = {Tier.PRIORITY: 1.0, Tier.DEFAULT: 1.0, Tier.FLEX: 1.0}


def fair_slots(capacity: int = 2, *, fifo: bool = False) -> ModelSlots:
    fair = {t: not fifo for t in Tier}
    made = ModelSlots("m", UTILIZATION, 1000, TIMING, fair)
    made.set_endpoints([(A, capacity // 2, 0.0), (B, capacity - capacity // 2, 0.0)])
    return made


def lid(account: str, n: int, weight: float = 1.0) -> str:
    return make_lease_id(f"r-{account}{n}", weight, account)


async def fill(m: Model, account: str, n: int, weight: float = 1.0) -> list[str]:
    """`n` leases of `account`, all granted at once."""
    ids = [lid(account, i, weight) for i in range(n)]
    for i in ids:
        assert (await m.acquire(i)).status == GRANTED
    return ids


async def queue_up(m: Model, account: str, n: int, weight: float = 1.0, at: int = 100) -> list[str]:
    ids = [lid(account, at + i, weight) for i in range(n)]
    for i in ids:
        assert (await m.acquire(i, may_wait=True)).status == QUEUED
    return ids


async def fair_keys(m: Model) -> list[str]:
    """The fair-share keys left in Redis (account queues, indexes, held counts)."""
    found = [text(k) for k in await m.client.keys("gw:v2:{m}:f[qi]:*")]
    if await m.client.exists("gw:v2:{m}:held"):
        found.append("held")
    return sorted(found)


async def test_a_freed_slot_goes_to_the_account_holding_fewer(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, fair_slots())
    held = await fill(m, "a", 2)
    a_waiting = await queue_up(m, "a", 5)
    b_waiting = await queue_up(m, "b", 2)
    assert await m.release(held[0]) == 1
    assert b_waiting[0] in await m.leases()  # b held none, a one: b's turn
    assert await m.release(held[1]) == 1
    assert a_waiting[0] in await m.leases()  # one each now: the oldest waiter, a's
    assert await m.release(b_waiting[0]) == 1
    assert b_waiting[1] in await m.leases()  # b holds none now
    assert await m.release(a_waiting[0]) == 1
    assert a_waiting[1] in await m.leases()  # a holds none now
    assert await m.queue() == a_waiting[2:]


async def test_fifo_tiers_keep_arrival_order(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, fair_slots(fifo=True))
    held = await fill(m, "a", 2)
    a_waiting = await queue_up(m, "a", 3)
    b_waiting = await queue_up(m, "b", 1)
    for lease in [*held, a_waiting[0]]:
        await m.release(lease)
    assert await m.queue() == b_waiting  # a's three went first
    assert a_waiting[2] in await m.leases()


async def test_weights_split_grants(real_redis: aioredis.Redis) -> None:
    """Weights 3 and 1 both saturating a model of 4: in flight settles at 3 and 1."""
    m = Model(real_redis, fair_slots(4))
    leases = await fill(m, "x", 4)
    a_waiting = await queue_up(m, "a", 40, weight=3)
    await queue_up(m, "b", 40, weight=1)
    served = {"a": 0, "b": 0}
    for _ in range(40):  # release the oldest lease; whoever was granted holds a slot
        await m.release(leases.pop(0))
        granted = (await m.leases()) - set(leases)
        assert len(granted) == 1
        (new,) = granted
        served["a" if new in a_waiting else "b"] += 1
        leases.append(new)
    assert served == {"a": 30, "b": 10}


async def test_priority_overtakes_every_default_waiter(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, fair_slots())
    held = await fill(m, "a", 2)
    await queue_up(m, "a", 3)
    await queue_up(m, "b", 3)
    vip = lid("c", 1)
    assert (await m.acquire(vip, Tier.PRIORITY, may_wait=True)).status == QUEUED
    assert (await m.queue())[0] == vip
    await m.release(held[0])
    assert vip in await m.leases()


async def test_cancel_of_an_account_head_moves_its_claim_on(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, fair_slots())
    held = await fill(m, "a", 2)
    a_waiting = await queue_up(m, "a", 2)
    b_waiting = await queue_up(m, "b", 2)
    # A waiter timing out hears its turn if it queued again (its Retry-After): b's own one
    # left, and one of a's for each of its two turns (an estimate: what each holds is left out).
    assert await m.run(m.slots.cancel(b_waiting[0])) == 3
    await m.release(held[0])
    assert b_waiting[1] in await m.leases()  # b's next waiter kept b's claim
    await m.release(b_waiting[1])
    assert a_waiting[0] in await m.leases()


async def test_nothing_is_left_behind(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, fair_slots())
    held = await fill(m, "a", 2)
    waiting = await queue_up(m, "a", 2) + await queue_up(m, "b", 2)
    await m.cancel(waiting[3])
    for lease in held + waiting[:3]:
        await m.release(lease)
    assert await m.leases() == set() and await m.queue() == []
    assert await fair_keys(m) == []


async def test_newcomers_estimate_their_own_position(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, fair_slots())
    await fill(m, "a", 2)
    await queue_up(m, "a", 10)
    b = await m.acquire(lid("b", 1), may_wait=True)
    assert (b.status, b.ahead, b.turn) == (QUEUED, 10, 1)  # a's next grant, then b's
    again = await m.acquire(lid("a", 99), may_wait=True)
    assert (again.ahead, again.turn) == (11, 11)  # behind a's own ten and b's one
    fifo = Model(real_redis, fair_slots(fifo=True))
    busy = await fifo.acquire(lid("b", 2))  # the same queue, in arrival order
    assert (busy.ahead, busy.turn) == (12, 12)


async def test_sweep_rebuilds_the_account_queues_redis_lost(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, fair_slots())
    held = await fill(m, "a", 2)
    places = {}
    for account, n in (("a", 3), ("b", 1)):
        for i in range(n):
            waiter = lid(account, 100 + i)
            queued = await m.acquire(waiter, may_wait=True)
            places[waiter] = Tier.DEFAULT.rank * RANK + queued.place
    await real_redis.flushdb()
    await m.sweep(leases=[(held[0], A), (held[1], B)], waiters=list(places.items()))
    await real_redis.delete(m.slots.keys[7])  # the rebuild window is over
    await m.release(held[0])
    assert lid("b", 100) in await m.leases()  # b's claim survived the loss


async def test_a_dead_replicas_leases_stop_counting(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, fair_slots())
    held = await fill(m, "a", 2)
    a_waiting = await queue_up(m, "a", 2)
    b_waiting = await queue_up(m, "b", 2)
    await m.expire_lease(held[0])
    await m.expire_lease(held[1])
    await m.sweep()  # two slots back: a holds none now, so one each in arrival order
    assert {a_waiting[0], b_waiting[0]} == await m.leases()


async def test_fair_share_runs_on_a_cluster(empty_cluster: RedisCluster) -> None:
    """The account queues and index are named inside the scripts under the model's hash tag:
    a Redis Cluster runs them on the model's node like the declared keys."""
    store = lean_store(empty_cluster)
    scripts = Scripts()
    made = fair_slots()

    async def run(call: Any) -> Any:
        if (index := made.index()) is not None:
            await asyncio.wait_for(scripts.call(store, index), 5)
        return await asyncio.wait_for(scripts.call(store, call), 5)

    try:
        held = [lid("a", i) for i in range(2)]
        for lease in held:
            assert (
                attempt(await run(made.acquire(lease, Tier.DEFAULT, may_wait=False))).status
                == GRANTED
            )
        waiting = [lid("a", 100), lid("a", 101), lid("b", 100)]
        for waiter in waiting:
            assert (
                attempt(await run(made.acquire(waiter, Tier.DEFAULT, may_wait=True))).status
                == QUEUED
            )
        assert int(await run(made.release([held[0]]))) == 1
        assert text(await run(made.cancel(waiting[2]))) in (A, B)  # b's waiter was granted
        assert isinstance(await run(made.cancel(waiting[0])), int)  # a's still queued
        await run(made.release([held[1], waiting[1], waiting[2]]))
    finally:
        await store.aclose()
