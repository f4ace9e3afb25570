"""Deadlines and preemption at the Redis level (docs/api.md, deadlines, preemption of flex): a
wait past its deadline is refused without queueing; a newcomer of a tier that may preempt
takes the slot of a flex lease that has not started (its holder told, the slot handed over
by the holder's release), never of one that has; one victim per waiter; a preempted
request may queue again at the head of flex."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from routing.admission.holdings import Lease
from routing.admission.preemption import Preemptions
from routing.admission.replies import Attempt, attempt
from routing.admission.slots import GRANTED, PAST_DEADLINE, QUEUED, ModelSlots, make_lease_id
from routing.store.wire import text
from tests.routing.admission.test_slots import TIMING, A, Model, next_message
from tiers.policy import Tier

# Every test here runs on both bindings of the scripts (tests/routing/conftest.py).
pytestmark = pytest.mark.usefixtures("script_modes")

UTILIZATION = {Tier.PRIORITY: 1.0, Tier.DEFAULT: 1.0, Tier.FLEX: 1.0}


def preemptible(size: int = 2, preempt: tuple[Tier, ...] = (Tier.PRIORITY,)) -> ModelSlots:
    made = ModelSlots("m", UTILIZATION, 100, TIMING, preempt=preempt)
    made.set_endpoints([(A, size, 0.0)])
    return made


def lid(name: str) -> str:
    return make_lease_id(f"r-{name}", 1, "acme")


async def started(m: Model, lease: str, endpoint: str = A) -> int:
    return int(await m.run(m.slots.start(lease, endpoint)))


async def attempt_of(m: Model, call: Any) -> Attempt:
    return attempt(await m.run(call))


async def doomed(m: Model) -> list[str]:
    return [text(x) for x in await m.client.zrange(m.slots.doomed_key, 0, -1)]


async def test_priority_takes_the_slot_of_a_flex_request_that_has_not_started(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, preemptible())
    flex = [lid("f1"), lid("f2")]
    for lease in flex:
        assert (await m.acquire(lease, Tier.FLEX)).status == GRANTED
    pubsub: Any = real_redis.pubsub()
    await pubsub.subscribe(m.slots.channel)
    try:
        vip = lid("vip")
        got = await m.acquire(vip, Tier.PRIORITY, may_wait=True)
        assert (got.status, got.preempted) == (QUEUED, True)
        assert await next_message(pubsub) == f"!{flex[1]} {A}"  # the latest granted
    finally:
        await pubsub.aclose()
    assert await doomed(m) == [flex[1]]
    assert await started(m, flex[1]) == 0  # its holder asks before its first byte: no
    assert await m.release(flex[1]) == 1  # its release hands the slot to the newcomer
    assert vip in await m.leases()
    assert await started(m, flex[0]) == 1  # the other one starts: never preempted now


async def test_a_flex_request_that_started_is_never_preempted(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, preemptible(size=1))
    flex = lid("f")
    assert (await m.acquire(flex, Tier.FLEX)).status == GRANTED
    assert await started(m, flex) == 1
    got = await m.acquire(lid("vip"), Tier.PRIORITY, may_wait=True)
    assert (got.status, got.preempted) == (QUEUED, False)  # it waits, as without preemption
    assert await doomed(m) == []


async def test_one_victim_per_waiter_and_none_for_tiers_that_may_not(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, preemptible(size=3))
    for i in range(3):
        assert (await m.acquire(lid(f"f{i}"), Tier.FLEX)).status == GRANTED
    assert (await m.acquire(lid("d"), Tier.DEFAULT, may_wait=True)).preempted is False
    assert (await m.acquire(lid("p1"), Tier.PRIORITY, may_wait=True)).preempted is True
    assert (await m.acquire(lid("p2"), Tier.PRIORITY, may_wait=True)).preempted is True
    assert len(await doomed(m)) == 2
    # Two on their way out for two priority waiters: a third would find one more.
    assert (await m.acquire(lid("p3"), Tier.PRIORITY, may_wait=True)).preempted is True
    assert len(await doomed(m)) == 3
    # Nothing left to take: the fourth waits as any waiter.
    assert (await m.acquire(lid("p4"), Tier.PRIORITY, may_wait=True)).preempted is False


async def test_without_a_tier_that_may_preempt_flex_is_never_offered(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, preemptible(size=1, preempt=()))
    assert (await m.acquire(lid("f"), Tier.FLEX)).status == GRANTED
    assert not await m.client.exists(m.slots.keys[11])  # `pre`: no flex lease offered
    assert (await m.acquire(lid("vip"), Tier.PRIORITY, may_wait=True)).preempted is False


async def test_a_wait_past_its_deadline_is_refused_and_never_queued(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, preemptible(size=1, preempt=()))
    assert (await m.acquire(lid("h"))).status == GRANTED
    for i in range(3):
        assert (await m.acquire(lid(f"w{i}"), may_wait=True)).status == QUEUED
    late = m.slots.acquire(lid("late"), Tier.DEFAULT, may_wait=True, max_turn=2)
    refused = await attempt_of(m, late)
    assert (refused.status, refused.turn) == (PAST_DEADLINE, 3)
    assert lid("late") not in await m.queue()
    fits = m.slots.acquire(lid("fits"), Tier.DEFAULT, may_wait=True, max_turn=3)
    assert (await attempt_of(m, fits)).status == QUEUED


async def test_a_preempted_request_queues_again_at_the_head_of_flex(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, preemptible(size=1, preempt=()))
    assert (await m.acquire(lid("h"))).status == GRANTED
    waiting = [lid(f"f{i}") for i in range(2)]
    for lease in waiting:
        assert (await m.acquire(lease, Tier.FLEX, may_wait=True)).status == QUEUED
    again = m.slots.acquire(lid("back"), Tier.FLEX, may_wait=True, at_head=True)
    assert (await attempt_of(m, again)).status == QUEUED
    assert await m.queue() == [lid("back"), *waiting]


class _Down:
    """Scripts whose every call finds Redis down (routing/store/scripts.py `call`)."""

    async def call(self, store: Any, call: Any) -> Any:
        raise RedisConnectionError("connection refused")


async def test_a_request_that_began_where_redis_was_down_is_never_cut_by_a_late_message() -> None:
    """Its check before its first byte got no answer, so it began (nobody could have chosen
    it where nothing answers). A Redis that comes back with its state may still offer it:
    a message choosing it then is not heeded, and its release clears the mark it left."""
    slots = preemptible()
    handback = SimpleNamespace(scripts=_Down(), store=None, slots={"m": slots})
    preemptions = Preemptions(handback)  # type: ignore[arg-type]
    lease = Lease(lid("f"), "m", A, "gw:v2:acct:{acme}", 0.0)
    told = preemptions.watch(lease.id)
    assert await preemptions.started(lease)
    preemptions.told(lease.id)  # chosen after it began
    assert not told.done()
    assert preemptions.done(lease, preempted=False) == [
        ("ZREM", [slots.pre_key], [f"{lease.id} {A}"]),  # Redis never heard it began
        ("ZREM", [slots.doomed_key], [lease.id]),
    ]
    assert preemptions.done(lease, preempted=False) == []  # once


async def test_a_request_that_ends_before_its_first_byte_is_no_longer_offered() -> None:
    """Its release takes it off `pre` (and `doomed`, should it have been chosen unseen):
    the sweep's cleanup is for holders that died, and stops when no tier may preempt."""
    slots = preemptible()
    handback = SimpleNamespace(scripts=_Down(), store=None, slots={"m": slots})
    preemptions = Preemptions(handback)  # type: ignore[arg-type]
    lease = Lease(lid("f"), "m", A, "gw:v2:acct:{acme}", 0.0)
    preemptions.watch(lease.id)
    assert preemptions.done(lease, preempted=False) == [
        ("ZREM", [slots.pre_key], [f"{lease.id} {A}"]),
        ("ZREM", [slots.doomed_key], [lease.id]),
    ]


async def test_a_request_that_began_unheard_is_no_longer_offered_once_redis_hears_it(
    real_redis: aioredis.Redis,
) -> None:
    """Its check got no answer, so it began; Redis still offers its lease (`pre`) until the
    check, sent again (the keeper's sweep: `unheard`), is answered: then a priority
    newcomer waits as for any request that started, instead of choosing it."""
    m = Model(real_redis, preemptible(size=1))
    flex = lid("f")
    assert (await m.acquire(flex, Tier.FLEX)).status == GRANTED
    handback = SimpleNamespace(scripts=_Down(), store=None, slots={"m": m.slots})
    preemptions = Preemptions(handback)  # type: ignore[arg-type]
    lease = Lease(flex, "m", A, "gw:v2:acct:{acme}", 0.0)
    preemptions.watch(lease.id)
    assert await preemptions.started(lease)
    ids, calls = preemptions.unheard()
    assert ids == [flex] and calls == [m.slots.start(flex, A)]
    preemptions.heard(ids, [RedisConnectionError("still down")])
    assert preemptions.unheard()[0] == [flex]  # sent again next time
    preemptions.heard(ids, [await m.run(call) for call in calls])
    assert preemptions.unheard() == ([], [])
    got = await m.acquire(lid("vip"), Tier.PRIORITY, may_wait=True)
    assert (got.status, got.preempted) == (QUEUED, False)
    assert await doomed(m) == []


async def test_a_request_chosen_before_redis_heard_it_began_is_still_not_cut(
    real_redis: aioredis.Redis,
) -> None:
    """Chosen while its check went unanswered: the check sent again says 0, which is heard
    but not obeyed (it has started); the message is ignored, and its release takes it off
    `pre` and `doomed`."""
    m = Model(real_redis, preemptible(size=1))
    flex = lid("f")
    assert (await m.acquire(flex, Tier.FLEX)).status == GRANTED
    handback = SimpleNamespace(scripts=_Down(), store=None, slots={"m": m.slots})
    preemptions = Preemptions(handback)  # type: ignore[arg-type]
    lease = Lease(flex, "m", A, "gw:v2:acct:{acme}", 0.0)
    told = preemptions.watch(lease.id)
    assert await preemptions.started(lease)
    assert (await m.acquire(lid("vip"), Tier.PRIORITY, may_wait=True)).preempted is True
    ids, calls = preemptions.unheard()
    replies = [await m.run(call) for call in calls]
    assert [int(r) for r in replies] == [0]
    preemptions.heard(ids, replies)
    preemptions.told(lease.id)
    assert not told.done() and preemptions.unheard() == ([], [])
    assert preemptions.done(lease, preempted=False) == [("ZREM", [m.slots.doomed_key], [flex])]


async def test_a_release_before_redis_heard_the_start_takes_the_lease_off_pre() -> None:
    slots = preemptible()
    handback = SimpleNamespace(scripts=_Down(), store=None, slots={"m": slots})
    preemptions = Preemptions(handback)  # type: ignore[arg-type]
    lease = Lease(lid("f"), "m", A, "gw:v2:acct:{acme}", 0.0)
    preemptions.watch(lease.id)
    assert await preemptions.started(lease)
    assert preemptions.done(lease, preempted=False) == [
        ("ZREM", [slots.pre_key], [f"{lease.id} {A}"]),
        ("ZREM", [slots.doomed_key], [lease.id]),
    ]
    assert preemptions.unheard() == ([], [])
