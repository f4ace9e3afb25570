"""The admission scripts (docs/api.md) at the Redis level: grants, ceilings, queue order, the
sweep's write-back of what Redis lost, claim times, and batches after a script flush."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis

import routing.admission.replies as replies_module
import routing.admission.slots as slots_module
from routing.admission.replies import Attempt, Sweep, attempt, sweep_result
from routing.admission.slots import (
    BUSY,
    FULL,
    GRANTED,
    NO_INDEX,
    QUEUED,
    RANK,
    UNBOUND,
    ModelSlots,
)
from routing.admission.timing import Timing
from routing.store.connect import RedisPyStore
from routing.store.keys import account_key
from routing.store.scripts import Scripts
from routing.store.wire import text
from tiers.policy import BY_RANK, Tier

# Every test here runs on both bindings of the scripts (tests/routing/conftest.py).
pytestmark = pytest.mark.usefixtures("script_modes")

A, B = "http://a:8000", "http://b:8000"
TTL_MS = 30_000
TIMING = Timing(lease_ttl_ms=TTL_MS, claim_ms=2_000, waiter_ttl_ms=3_000)


def slots(
    endpoints: Sequence[tuple[str, int]] = ((A, 1), (B, 1)),
    *,
    max_queue: int = 10,
    flex: float = 0.8,
    priority: float = 1.0,
    model: str = "m",
    timing: Timing = TIMING,
    declare_all: bool = True,
) -> ModelSlots:
    utilization = {Tier.PRIORITY: priority, Tier.DEFAULT: 1.0, Tier.FLEX: flex}
    made = ModelSlots(model, utilization, max_queue, timing, declare_all=declare_all)
    made.configured = frozenset(url for url, _ in endpoints)  # all in rotation, as at start
    made.set_endpoints([(url, size, 0.0) for url, size in endpoints])
    return made


class Model:
    """A ModelSlots and the scripts, bound to one client: each method is one script call."""

    def __init__(self, client: aioredis.Redis, model: ModelSlots) -> None:
        self.client = client
        self.store = RedisPyStore(client, 2.0)
        self.slots = model
        self.scripts = Scripts()

    async def run(self, call: Any) -> Any:
        """The call, behind the endpoint index's change if there is one (as the gateway
        writes it when its endpoints change)."""
        await self.write_index()
        return await asyncio.wait_for(self.scripts.call(self.store, call), 5)

    async def write_index(self) -> None:
        """The endpoint index, written as the gateway writes it (before calls sent here
        directly, not through `run`)."""
        if (index := self.slots.index()) is not None:
            await asyncio.wait_for(self.scripts.call(self.store, index), 5)

    async def acquire(
        self,
        lease_id: str,
        tier: Tier = Tier.DEFAULT,
        *,
        may_wait: bool = False,
        affinity: Sequence[str] | None = None,
    ) -> Attempt:
        call = self.slots.acquire(lease_id, tier, may_wait=may_wait, affinity=affinity)
        result = attempt(await self.run(call))
        if result.status == NO_INDEX:  # Redis has none (restarted empty): written, then again
            self.slots.rewrite()
            result = attempt(await self.run(call))
        return result

    async def release(self, *ids: str) -> int:
        return int(await self.run(self.slots.release(ids)))

    async def cancel(self, waiter_id: str) -> str:
        reply = await self.run(self.slots.cancel(waiter_id))
        return "" if isinstance(reply, int) else text(reply)  # an int: it was still queued

    async def sweep(
        self,
        leases: Sequence[tuple[str, str]] = (),
        waiters: Sequence[tuple[str, int]] = (),
        pending: Sequence[str] = (),
    ) -> Sweep:
        found = sweep_result(await self.run(self.slots.sweep(leases, waiters, pending)))
        self.slots.saw(found.state.version)  # another index than its own: written again
        return found

    async def state(self) -> list[int]:
        """A sweep holding nothing: [inflight, queued p/d/f, freed]."""
        state = (await self.sweep()).state
        queued = [state.queued[t] for t in (Tier.PRIORITY, Tier.DEFAULT, Tier.FLEX)]
        return [state.inflight, *queued, state.freed]

    async def member(self, lease_id: str) -> str | None:
        """The lease's member in `leases` ("id url"), None if it holds none."""
        for m in map(text, await self.client.zrange(self.slots.keys[0], 0, -1)):
            if m.split(" ")[0] == lease_id:
                return m
        return None

    async def expiry(self, lease_id: str) -> float | None:
        member = await self.member(lease_id)
        return None if member is None else await self.client.zscore(self.slots.keys[0], member)

    async def now_ms(self) -> int:
        seconds, micros = await self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def leases(self) -> set[str]:
        return {text(m).split(" ")[0] for m in await self.client.zrange(self.slots.keys[0], 0, -1)}

    async def queue(self) -> list[str]:
        return [text(m) for m in await self.client.zrange(self.slots.keys[1], 0, -1)]

    async def load(self) -> dict[str, int]:
        """Leases per endpoint (ep_load also holds the state marker `~s`)."""
        raw = await self.client.hgetall(self.slots.keys[3])
        return {text(k): int(v) for k, v in raw.items() if not text(k).startswith("~")}

    async def expire_lease(self, lease_id: str) -> None:
        """Push a lease's expiry into the past, as if its holder had died."""
        member = await self.member(lease_id)
        assert member is not None
        assert await self.client.zadd(self.slots.keys[0], {member: 1}, xx=True, ch=True) == 1


async def next_message(pubsub: Any, *, timed: bool = False) -> str:
    """The next published message's data (subscribe confirmations skipped); a grant's
    time ("@<ms> ", Redis's clock) taken off unless `timed`."""

    async def read() -> str:
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None:
                return text(message["data"])

    data = await asyncio.wait_for(read(), 5)
    return data if timed else re.sub(r"^@\d+ ", "", data)


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
    assert (queued.status, queued.ahead) == (QUEUED, 0)  # (a waiter is not told inflight)
    assert await m.queue() == ["w1"]
    assert await m.release("l1") == 1  # handed on to the waiter
    assert await m.leases() == {"l2", "w1"}
    assert await m.queue() == []
    assert await m.release("l2", "w1") == 0
    assert await m.leases() == set()
    assert await m.load() == {A: 0, B: 0}


async def test_grants_until_capacity_then_busy(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    first, second = await m.acquire("l1"), await m.acquire("l2")
    assert (first.status, second.status) == (GRANTED, GRANTED)
    assert {first.endpoint, second.endpoint} == {A, B}
    for tier in Tier:
        late = await m.acquire(f"late-{tier}", tier)
        assert (late.status, late.inflight) == (BUSY, 2)
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


async def test_a_ceiling_at_the_endpoints_sum_is_left_to_them(real_redis: aioredis.Redis) -> None:
    """Leases on an endpoint this replica does not know (another replica's config, during a
    reload) do not hold up its own endpoints; a ceiling below their sum (flex) counts every
    lease; and while one of its endpoints is out of rotation, the leases still on it count
    (a request moved off it needs the room)."""
    C = "http://c:8000"
    other = Model(real_redis, slots([(A, 1), (B, 1), (C, 2)]))
    assert [(await other.acquire(f"o{i}", affinity=[C])).endpoint for i in range(2)] == [C, C]
    m = Model(real_redis, slots())
    assert m.slots.acquire("x", Tier.DEFAULT, may_wait=False)[2][3] == UNBOUND
    assert (await m.acquire("f", Tier.FLEX)).status == BUSY  # 2 leases, ceiling 1.6
    held = (await m.acquire("d", Tier.DEFAULT)).endpoint
    assert held in (A, B)
    await other.release("o0", "o1")
    # Its endpoint out of rotation here, still holding it: the ceiling (1) binds again,
    # though the endpoint left has room.
    m.slots.set_endpoints([(e, 1, 0.0) for e in (A, B) if e != held])
    assert m.slots.acquire("x", Tier.DEFAULT, may_wait=False)[2][3] == 1.0
    assert (await m.acquire("d2", Tier.DEFAULT)).status == BUSY
    await m.release("d")


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


async def test_affinity_to_a_full_endpoint_takes_the_least_loaded(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots())
    assert (await m.acquire("l1", affinity=[A])).endpoint == A
    assert (await m.acquire("l2", affinity=[A])).endpoint == B
    assert (await m.acquire("l3", affinity=[A])).status == BUSY


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
        when, _, grant = (await next_message(pubsub, timed=True)).partition(" ")
        assert grant == f"B {first}"  # said with when, by Redis's clock
        seconds, _ = await real_redis.time()
        assert abs(int(when[1:]) - seconds * 1000) < 60_000
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
    # Someone waits: the newcomer leaves the expired lease to the sweep, which hands it on.
    assert await m.leases() == {"l1", "l2"}
    await m.sweep()
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
    assert (newcomer.status, newcomer.ahead) == (QUEUED, 2)
    assert await m.queue() == ["w1", "w2", "n"]
    await m.sweep()  # the expired slot goes to the head
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


async def test_queue_full_counts_the_waiters_ahead(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots(max_queue=2))
    await m.acquire("l1")
    await m.acquire("l2")
    assert (await m.acquire("f1", Tier.FLEX, may_wait=True)).status == QUEUED
    assert (await m.acquire("f2", Tier.FLEX, may_wait=True)).status == QUEUED
    full = await m.acquire("f3", Tier.FLEX, may_wait=True)
    assert (full.status, full.endpoint, full.ahead) == (FULL, "", 2)
    # Flex waiters never make a better tier's queue full: it waits ahead of them.
    assert (await m.acquire("d1", Tier.DEFAULT, may_wait=True)).status == QUEUED
    assert (await m.acquire("p1", Tier.PRIORITY, may_wait=True)).status == QUEUED
    assert (await m.acquire("d2", Tier.DEFAULT, may_wait=True)).status == FULL  # p1, d1 ahead
    assert (await m.acquire("p2", Tier.PRIORITY, may_wait=True)).status == QUEUED
    assert (await m.acquire("p3", Tier.PRIORITY, may_wait=True)).status == FULL
    assert await m.queue() == ["p1", "p2", "d1", "f1", "f2"]


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
    assert await m.state() == [0, 0, 0, 0, 2]
    assert await m.leases() == set()
    assert await m.load() == {A: 0, B: 0}
    assert await real_redis.hlen(m.slots.keys[2]) == 0


async def test_a_lease_of_an_older_release_is_reclaimed_with_its_endpoint_load(
    real_redis: aioredis.Redis,
) -> None:
    """A rolling update: a replica of the release before leases named their endpoint wrote
    the lease as its id alone, its endpoint in `ep_of`; it dies. The sweep reclaims the
    lease and takes its endpoint's load back, and leaves no `ep_of` entry."""
    m = Model(real_redis, slots())
    keys = m.slots.keys
    await m.sweep()  # the model's state exists
    await real_redis.zadd(keys[0], {"old-1": 1})  # expired long ago
    await real_redis.hset(keys[2], "old-1", A)
    await real_redis.hincrby(keys[3], A, 1)
    await m.sweep()
    assert await m.leases() == set()
    assert await m.load() == {A: 0}
    assert not await real_redis.exists(keys[2])


async def test_an_idle_sweep_mends_endpoint_loads_nobody_holds(real_redis: aioredis.Redis) -> None:
    """A load that could not be taken back (an older release reclaimed a lease without
    knowing its endpoint) is set to 0 by the first sweep that finds no lease at all."""
    m = Model(real_redis, slots())
    await m.sweep()
    await real_redis.hincrby(m.slots.keys[3], B, 3)
    held = await m.acquire("l1")
    await m.sweep()
    assert (await m.load())[B] == 3 + (held.endpoint == B)  # leases held: left as it is
    await m.release("l1")
    await m.sweep()
    assert await m.load() == {A: 0, B: 0}


async def test_sweep_hands_reclaimed_slots_to_waiters_and_reports_queues(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    await m.acquire("p", Tier.PRIORITY, may_wait=True)
    await m.acquire("d", Tier.DEFAULT, may_wait=True)
    await m.acquire("f", Tier.FLEX, may_wait=True)
    assert await m.state() == [2, 1, 1, 1, 0]
    await m.expire_lease("l1")
    assert await m.state() == [2, 0, 1, 1, 1]
    assert await m.leases() == {"l2", "p"}


async def test_sweep_drops_waiters_past_their_give_up_time(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    await m.acquire("gone", may_wait=True)
    await m.acquire("alive", may_wait=True)
    await real_redis.zadd(m.slots.keys[6], {"gone": 1}, xx=True)
    assert await m.state() == [2, 0, 1, 0, 0]
    assert await m.queue() == ["alive"]
    assert await m.release("l1") == 1
    assert await m.leases() == {"l2", "alive"}


async def test_account_limit(real_redis: aioredis.Redis) -> None:
    scripts, store = Scripts(), RedisPyStore(real_redis, 2.0)
    key = account_key("acme")

    async def take(lease_id: str) -> int:
        return int(await scripts.call(store, ("account", [key], [lease_id, 2, TTL_MS])))

    assert [await take("a1"), await take("a2"), await take("a3")] == [1, 1, 0]
    assert await real_redis.zcard(key) == 2
    # The key expires with its newest entry: what a dead replica left does not stay forever.
    assert 0 < await real_redis.pttl(key) <= TTL_MS
    await real_redis.zadd(key, {"a1": 1}, xx=True)  # expired: no longer counts
    assert await take("a4") == 1
    assert {text(m) for m in await real_redis.zrange(key, 0, -1)} == {"a2", "a4"}
    assert await take("a5") == 0


async def test_send_recovers_from_a_flushed_script_cache(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    await m.write_index()
    await real_redis.script_flush()
    await real_redis.function_flush()  # a restart empties both
    replies = await m.scripts.send(
        m.store,
        [
            m.slots.acquire("l1", Tier.DEFAULT, may_wait=False),
            ("ZCARD", [m.slots.keys[0]], []),
        ],
    )
    assert attempt(replies[0]).status == GRANTED
    # The plain command ran in the first round trip and was not sent again.
    assert int(replies[1]) == 0
    assert await real_redis.zcard(m.slots.keys[0]) == 1
    assert all(await real_redis.script_exists(*m.scripts.loaded.values()))


async def test_a_flush_resends_only_the_calls_that_did_not_run(
    real_redis: aioredis.Redis,
) -> None:
    """Redis loaded one script but not the other (e.g. a failover between two loads): the
    account call ran, the acquire did not; only the acquire is resent, so the account
    counts the request once."""
    m = Model(real_redis, slots())
    await m.write_index()
    await real_redis.script_flush()
    account_text = m.scripts._text["account"]
    assert text(await real_redis.script_load(account_text)) == m.scripts.sha["account"]
    key = account_key("t-once")
    replies = await m.scripts.send(
        m.store,
        [
            ("account", [key], ["l1", 5, TTL_MS]),
            m.slots.acquire("l1", Tier.DEFAULT, may_wait=False),
        ],
    )
    assert int(replies[0]) == 1
    assert attempt(replies[1]).status == GRANTED
    assert await real_redis.zcard(key) == 1


async def test_a_failing_call_leaves_the_others_replies_in_place(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots())
    await m.write_index()
    await real_redis.set("t-not-a-zset", "x")
    replies = await m.scripts.send(
        m.store,
        [m.slots.acquire("l1", Tier.DEFAULT, may_wait=False), ("ZCARD", ["t-not-a-zset"], [])],
    )
    assert attempt(replies[0]).status == GRANTED
    assert isinstance(replies[1], Exception)
    await real_redis.delete("t-not-a-zset")


# --- what Redis lost, written back by its holders --------------------------------------------


async def test_sweep_writes_back_leases_redis_lost(any_redis: aioredis.Redis) -> None:
    m = Model(any_redis, slots())
    assert (await m.acquire("l1", affinity=[A])).endpoint == A
    await any_redis.flushdb()  # Redis restarted empty
    found = await m.sweep(leases=[("l1", A), ("l2", B)])
    assert found.restored == ["l1", "l2"]
    assert found.state.inflight == 2
    assert await m.load() == {A: 1, B: 1}
    assert (await m.acquire("n")).status == BUSY  # counted again: no over-admission
    again = await m.sweep(leases=[("l1", A), ("l2", B)])
    assert again.restored == []  # kept alive, not written twice
    assert await m.load() == {A: 1, B: 1}


async def test_sweep_keeps_leases_alive(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    await m.acquire("l1")
    soon = await m.now_ms() + 1000
    await real_redis.zadd(m.slots.keys[0], {"l1": soon}, xx=True)
    await m.sweep(leases=[("l1", A)])
    assert (await m.expiry("l1") or 0) > soon + 20_000


async def test_sweep_requeues_lost_waiters_at_their_place(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    places = {}
    for waiter, tier in (("d1", Tier.DEFAULT), ("p1", Tier.PRIORITY), ("d2", Tier.DEFAULT)):
        queued = await m.acquire(waiter, tier, may_wait=True)
        places[waiter] = tier.rank * RANK + queued.place
    await real_redis.flushdb()
    # A newcomer arrives before the sweep: it waits, but behind the older waiters once they
    # are back (the sequence is moved past theirs).
    held = [("l1", A), ("l2", B)]
    found = await m.sweep(leases=held, waiters=[(w, p) for w, p in places.items()])
    assert found.granted == ["", "", ""]
    assert await m.queue() == ["p1", "d1", "d2"]
    # While the rebuild window lasts, a newcomer does not queue (its account may not be
    # counted right yet): it is told to retry.
    assert (await m.acquire("late", Tier.DEFAULT, may_wait=True)).status == BUSY
    await real_redis.delete(m.slots.keys[7])  # the rebuild window is over
    late = await m.acquire("late", Tier.DEFAULT, may_wait=True)
    assert late.status == QUEUED
    assert await m.queue() == ["p1", "d1", "d2", "late"]
    assert await m.release("l1") == 1
    assert "p1" in await m.leases()


async def test_a_replica_that_finds_the_state_gone_pauses_grants(
    real_redis: aioredis.Redis,
) -> None:
    """Redis restarted empty and no sweep has run yet: a request to a replica that has
    seen the model's state before is not granted a slot that may be held (the holders
    write theirs back within the window); a first start grants at once."""
    m = Model(real_redis, slots())
    assert (await m.acquire("first")).status == GRANTED  # a first start: nothing to wait for
    m.slots.known = True  # this replica's sweeps have seen the model's state
    await real_redis.flushdb()
    assert (await m.acquire("n1")).status == BUSY  # room, but the state was lost
    assert (await m.acquire("n2", may_wait=True)).status == BUSY  # nor does anyone queue
    assert (await real_redis.pttl(m.slots.keys[7])) > 0
    await real_redis.delete(m.slots.keys[7])  # the window ends
    assert (await m.acquire("n3")).status == GRANTED
    assert (await m.acquire("n4")).status == GRANTED
    later = await m.acquire("n5", may_wait=True)
    assert later.status == QUEUED
    assert later.place > 10**12  # the sequence restarted from Redis TIME, after old places


async def test_a_sweep_that_wrote_back_pauses_grants_for_the_other_replicas(
    real_redis: aioredis.Redis,
) -> None:
    """Replica A sweeps first after a restart: its leases are back, replica B's not yet.
    The free-looking slots are B's; nothing is granted until B has swept too."""
    m = Model(real_redis, slots())
    assert (await m.acquire("a1", affinity=[A])).endpoint == A
    assert (await m.acquire("b1", affinity=[B])).endpoint == B
    waiting = await m.acquire("wa", may_wait=True)
    await real_redis.flushdb()
    place = Tier.DEFAULT.rank * RANK + waiting.place
    await m.sweep(leases=[("a1", A)], waiters=[("wa", place)])  # replica A
    assert await m.queue() == ["wa"]  # not granted B's slot
    assert (await m.acquire("n")).status == BUSY
    assert (await real_redis.pttl(m.slots.keys[7])) > 0
    found = await m.sweep(leases=[("b1", B)])  # replica B, within the window
    assert found.restored == ["b1"] and found.state.inflight == 2
    await real_redis.delete(m.slots.keys[7])  # the window ends
    assert (await m.acquire("n2")).status == BUSY  # full, now truly
    await m.release("b1")
    assert await m.leases() == {"a1", "wa"}


async def test_sweep_claims_a_grant_whose_wake_up_was_lost(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    queued = await m.acquire("w", may_wait=True)
    place = Tier.DEFAULT.rank * RANK + queued.place
    await m.release("l1")  # granted to w, for the claim time only
    granted_until = await m.expiry("w")
    assert granted_until is not None and granted_until <= await m.now_ms() + TIMING.claim_ms
    found = await m.sweep(waiters=[("w", place)])
    assert found.granted == [A] or found.granted == [B]
    assert (await m.expiry("w") or 0) > await m.now_ms() + TIMING.claim_ms  # claimed


async def test_unclaimed_grant_goes_back_after_the_claim_time(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    await m.acquire("dead", may_wait=True)  # its replica is gone: nobody will claim
    await m.acquire("live", may_wait=True)
    await m.release("l1")
    assert "dead" in await m.leases()
    await m.expire_lease("dead")  # the claim time has passed
    assert await m.state() == [2, 0, 0, 0, 2]
    assert await m.leases() == {"l2", "live"}


async def test_waiters_nobody_keeps_alive_leave_the_queue(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    kept = await m.acquire("kept", may_wait=True)
    await m.acquire("dead", may_wait=True)
    await real_redis.zadd(m.slots.keys[6], {"kept": 1, "dead": 1}, xx=True)  # both stale...
    place = Tier.DEFAULT.rank * RANK + kept.place
    await m.sweep(waiters=[("kept", place)])  # ...but kept's replica is alive and says so
    assert await m.queue() == ["kept"]


async def test_a_low_priority_ceiling_does_not_stall_default_waiters(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots([(A, 4)], priority=0.5))
    for i in range(4):
        await m.acquire(f"l{i}")
    assert (await m.acquire("p", Tier.PRIORITY, may_wait=True)).status == QUEUED
    assert (await m.acquire("d", Tier.DEFAULT, may_wait=True)).status == QUEUED
    await m.release("l0")  # 3 in flight: over priority's ceiling of 2, under default's 4
    assert "d" in await m.leases()
    assert await m.queue() == ["p"]
    await m.release("l1", "l2", "d")  # 1 in flight
    assert "p" in await m.leases()


async def test_move_keeps_the_slot_from_the_queue(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots([(A, 1), (B, 2)]))
    assert (await m.acquire("l1", affinity=[A])).endpoint == A
    await m.acquire("l2", affinity=[B])
    await m.acquire("l3", affinity=[B])
    assert (await m.acquire("w", may_wait=True)).status == QUEUED
    await m.release("l3")  # B has room now, and w took it
    assert await m.load() == {A: 1, B: 2}
    assert (
        text(await m.run(m.slots.move("l1", A, tier=Tier.DEFAULT))) == ""
    )  # nowhere to go: stays on A
    await m.release("w")
    assert text(await m.run(m.slots.move("l1", A, tier=Tier.DEFAULT))) == B
    assert await m.load() == {A: 0, B: 2}
    assert await m.queue() == []


async def test_account_keep_writes_back_lost_entries(real_redis: aioredis.Redis) -> None:
    scripts, store = Scripts(), RedisPyStore(real_redis, 2.0)
    key = account_key("t-keep")
    await scripts.call(store, ("account", [key], ["a1", 5, TTL_MS]))
    await real_redis.delete(key)
    restored = await scripts.call(store, ("account_keep", [key], [TTL_MS, "", "", 2, "a1", "a2"]))
    assert [[text(r) for r in each] for each in restored] == [["a1", "a2"]]
    again = await scripts.call(store, ("account_keep", [key], [TTL_MS, "", "", 1, "a1"]))
    assert again == [[]]
    assert await real_redis.zcard(key) == 2
    assert 0 < await real_redis.pttl(key) <= TTL_MS
    await real_redis.delete(key)


async def test_a_keep_after_lost_writes_takes_out_the_entries_no_request_holds(
    real_redis: aioredis.Redis,
) -> None:
    """A failover that lost writes brought back entries this replica had given back: its
    keep of all it holds (its id, the number its ids reached) takes out every other entry of
    its ids up to that number, but those of walks under way, of ids issued later, and of
    other replicas (one whose id starts with its own too)."""
    scripts, store = Scripts(), RedisPyStore(real_redis, 2.0)
    keys = [account_key("t-purge-1"), account_key("t-purge-2")]
    far = 1e15
    await real_redis.zadd(
        keys[0],
        {
            i: far
            for i in ("r1-1~1~a", "r1-2~1~a", "r1-3~1~a", "r1-9~1~a", "r1-2-1~1~a", "r2-1~1~a")
        },
    )
    await real_redis.zadd(keys[1], {"r1-4~1~b": far})  # (an account it holds nothing in now)
    args = [TTL_MS, "r1", 5, 1, "r1-1~1~a", 1, "r1-3~1~a", 0, 0]
    reply = await scripts.call(store, ("account_keep", keys, args))
    assert reply == [[], []]
    left = {text(i) for i in await real_redis.zrange(keys[0], 0, -1)}
    assert left == {"r1-1~1~a", "r1-3~1~a", "r1-9~1~a", "r1-2-1~1~a", "r2-1~1~a"}
    assert await real_redis.exists(keys[1]) == 0
    await real_redis.delete(*keys)


async def test_one_account_keep_call_keeps_several_accounts(real_redis: aioredis.Redis) -> None:
    """On one Redis the keeper sends many accounts in one call: each key its own ids."""
    scripts, store = Scripts(), RedisPyStore(real_redis, 2.0)
    keys = [account_key(f"t-keep-{i}") for i in range(3)]
    await real_redis.zadd(keys[1], {"b1": 1e15})
    args = [TTL_MS, "", "", 2, "a1", "a2", 1, "b1", 0, 1, "c1"]
    reply = await scripts.call(
        store, ("account_keep", [*keys[:2], account_key("t-none"), keys[2]], args)
    )
    assert [[text(r) for r in each] for each in reply] == [["a1", "a2"], [], [], ["c1"]]
    assert [await real_redis.zcard(k) for k in keys] == [2, 1, 1]
    assert await real_redis.exists(account_key("t-none")) == 0
    await real_redis.delete(*keys)


async def test_equal_loads_take_turns(real_redis: aioredis.Redis) -> None:
    m = Model(real_redis, slots([(A, 4), (B, 4)]))
    picked = []
    for i in range(6):
        picked.append((await m.acquire(f"t{i}")).endpoint)
        await m.release(f"t{i}")
    assert picked.count(A) == 3 and picked.count(B) == 3


async def test_the_scripts_take_any_number_of_tiers(
    real_redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fourth tier (behind flex) is no Lua edit: ceilings go as a counted list and the
    sweep answers one queue length per tier."""

    class Bulk:  # a stand-in for a fourth Tier member: what the scripts see of a tier
        rank = 3
        preemptible = False

    bulk: Any = Bulk()
    monkeypatch.setattr(slots_module, "BY_RANK", (*BY_RANK, bulk))
    monkeypatch.setattr(replies_module, "BY_RANK", (*BY_RANK, bulk))
    utilization = {Tier.PRIORITY: 1.0, Tier.DEFAULT: 1.0, Tier.FLEX: 1.0, bulk: 1.0}
    made = ModelSlots("m", utilization, 10, TIMING)
    made.set_endpoints([(A, 1, 0.0), (B, 1, 0.0)])
    m = Model(real_redis, made)
    assert (await m.acquire("l1")).status == GRANTED
    assert (await m.acquire("l2")).status == GRANTED
    assert (await m.acquire("w-bulk", bulk, may_wait=True)).status == QUEUED
    assert (await m.acquire("w-flex", Tier.FLEX, may_wait=True)).status == QUEUED
    assert await m.queue() == ["w-flex", "w-bulk"]
    state = (await m.sweep()).state
    assert state.queued == {Tier.PRIORITY: 0, Tier.DEFAULT: 0, Tier.FLEX: 1, bulk: 1}
    assert await m.release("l1") == 1
    assert await m.queue() == ["w-bulk"]
    assert await m.release("l2") == 1
    assert await m.queue() == []
    await m.release("w-flex", "w-bulk")


async def test_a_sweep_that_writes_back_still_finds_its_waiters_grants(
    real_redis: aioredis.Redis,
) -> None:
    """A replica's sweeps were late: its lease l2 expired and another replica's sweep
    reclaimed it; meanwhile its waiter w was granted a slot (the wake-up not read yet).
    Its next sweep writes l2 back and must still find w's grant (found by its member now:
    no `ep_of`), not queue w again as if Redis had lost it: w would hold its grant and
    wait for a second slot, counted twice on its endpoint if granted there again."""
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    queued = await m.acquire("w", may_wait=True)
    place = Tier.DEFAULT.rank * RANK + queued.place
    assert await m.release("l1") == 1  # granted to w (its wake-up still on the way)
    ep = (await m.member("w") or "").split(" ")[1]
    l2_at = (await m.member("l2") or "").split(" ")[1]
    await m.expire_lease("l2")
    await m.sweep()  # another replica's sweep reclaims l2
    found = await m.sweep(leases=[("l2", l2_at)], waiters=[("w", place)])
    assert found.restored == ["l2"]
    assert found.granted == [ep]
    assert await m.queue() == []
    assert await m.leases() == {"l2", "w"}
    assert await m.load() == {A: 1, B: 1}


async def test_no_grant_of_an_older_release_is_left_in_ep_of(real_redis: aioredis.Redis) -> None:
    """A rolling update: a replica of the release before hands a slot to a waiter of this
    release and writes the grant in `ep_of` (its holder claimed it there, which deleted the
    entry; this release never claims). The holder's sweep keeps the lease by its member and
    its release gives it back on its endpoint: once nothing is held, no entry is left."""
    m = Model(real_redis, slots())
    await m.acquire("l1")
    await m.acquire("l2")
    assert (await m.acquire("w", may_wait=True)).status == QUEUED
    assert await m.release("l1") == 1
    ep = (await m.member("w") or "").split(" ")[1]
    l2_at = (await m.member("l2") or "").split(" ")[1]
    await real_redis.hset(m.slots.keys[2], "w", ep)  # as the older release's grant wrote it
    await m.sweep(leases=[("w", ep), ("l2", l2_at)])  # kept, as every lease
    await m.run(m.slots.release(["w"], endpoint=ep))
    await m.run(m.slots.release(["l2"], endpoint=l2_at))
    await m.sweep()
    assert await m.leases() == set()
    assert not await real_redis.exists(m.slots.keys[2])


async def test_a_sweep_keeps_thousands_of_waiters_in_a_few_calls(
    real_redis: aioredis.Redis,
) -> None:
    """A replica's 2,500 waiters (more than one batch of 1,000): each still queued is kept
    alive, one Redis lost is queued again at its place, one granted meanwhile is found, and
    the waiters cost the sweep a few calls, not three each."""
    m = Model(real_redis, slots(max_queue=5000))
    await m.acquire("l1")
    await m.acquire("l2")
    waiters = []
    for i in range(2500):
        got = await m.acquire(f"w{i}", may_wait=True)
        waiters.append((f"w{i}", Tier.DEFAULT.rank * RANK + got.place))
    assert await m.release("l1") == 1  # w0 granted
    await real_redis.zrem(m.slots.keys[1], "w1999")  # lost: Redis forgot it
    qexp = m.slots.keys[6]
    soon = await m.now_ms() + 1000  # their liveness about to run out
    await real_redis.zadd(qexp, {w: soon for w, _ in waiters[1:]}, xx=True)
    before = await real_redis.info("commandstats")
    found = await m.sweep(waiters=waiters)
    after = await real_redis.info("commandstats")
    assert found.granted[0] in (A, B) and set(found.granted[1:]) == {""}
    assert (await m.queue())[:2] == ["w1", "w2"] and "w1999" in await m.queue()
    assert await real_redis.zcard(m.slots.keys[1]) == 2499
    scores = await real_redis.zmscore(qexp, [w for w, _ in waiters[1:]])
    assert all(s is not None and s > soon for s in scores)  # kept for the waiter TTL

    def calls(stats: dict[str, Any], name: str) -> int:
        return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))

    assert calls(after, "zadd") - calls(before, "zadd") < 20
    assert calls(after, "zscore") - calls(before, "zscore") < 20


async def test_a_sweep_keeps_thousands_of_leases_in_a_few_calls(real_redis: aioredis.Redis) -> None:
    """A replica's 2,500 leases (more than one batch of 1,000): each Redis holds is kept for
    the lease TTL, one Redis lost is written back, and they cost the sweep a few calls, not
    four each."""
    m = Model(real_redis, slots([(A, 3000)]))
    leases = []
    for i in range(2500):
        leases.append((f"l{i}", (await m.acquire(f"l{i}")).endpoint))
    await real_redis.zrem(m.slots.keys[0], f"l7 {A}")  # lost: Redis forgot it
    await real_redis.hincrby(m.slots.keys[3], A, -1)
    soon = await m.now_ms() + 1000  # their expiry about to come
    await real_redis.zadd(m.slots.keys[0], {f"{i} {e}": soon for i, e in leases}, xx=True)
    before = await real_redis.info("commandstats")
    found = await m.sweep(leases=leases)
    after = await real_redis.info("commandstats")
    assert found.restored == ["l7"]
    assert await m.load() == {A: 2500}
    scores = await real_redis.zmscore(m.slots.keys[0], [f"{i} {e}" for i, e in leases])
    assert all(s is not None and s > soon + 10_000 for s in scores)  # the lease TTL, 30 s

    def calls(stats: dict[str, Any], name: str) -> int:
        return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))

    assert calls(after, "zadd") - calls(before, "zadd") < 20
    assert calls(after, "zscore") - calls(before, "zscore") < 20


async def test_a_sweep_looks_for_its_pending_ids_within_a_bound(real_redis: aioredis.Redis) -> None:
    """Ids that may hold a lease the replica does not know of yet are looked for on every
    endpoint: at a busy replica's thousands of acquires in flight times a thousand endpoints
    that blocked Redis for seconds (BUSY). Past 5,000 lookups none is looked for: the local
    share counts fewer than the replica holds, never more."""
    urls = [f"http://10.0.0.{i}:8000" for i in range(10)]  # (ep_load counts those used)
    m = Model(real_redis, slots([(u, 1) for u in urls]))
    held = await m.acquire("p-1")
    assert held.endpoint in urls
    assert (await m.sweep(pending=["p-1", "p-none"])).mine == 1
    fields = await real_redis.hkeys("gw:v2:{m}:ep_load")
    counted = sum(1 for f in fields if not text(f).startswith("~"))  # the endpoints looked at
    assert counted >= 1
    at_bound = 5000 // counted
    many = ["p-1", *(f"p-{i}" for i in range(2, at_bound + 1))]
    assert (await m.sweep(pending=many)).mine == 1
    assert (await m.sweep(pending=[*many, "p-over"])).mine == 0  # past it: not looked for
    assert await m.release("p-1") == 0
    assert await real_redis.zcard("gw:v2:{m}:leases") == 0
