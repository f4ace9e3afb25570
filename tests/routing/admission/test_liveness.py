"""A replica's waiters live by its sweeps' word that it is alive in the model (`alive`,
prelude `bury`), not by each waiter's own entry kept at every sweep: a waiter costs its
replica's sweeps nothing while it waits. Against the run's Redis, by the scripts alone."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import redis.asyncio as aioredis

from routing.admission.replies import Sweep, sweep_result
from routing.admission.slots import RANK, make_lease_id
from routing.store.keys import MODEL, account_key
from routing.store.wire import text
from tests.routing.admission.test_slots import TIMING, Model, slots
from tests.routing.admission.test_slots import A as A_URL
from tiers.policy import Tier

pytestmark = pytest.mark.usefixtures("script_modes")

DAY_MS = 86_400_000


def waiter(replica: str, n: int, account: str = "acct") -> str:
    """A waiter's id as a replica makes it: "<replica>-<n>~...": whose it is, from the id."""
    return make_lease_id(f"{replica}-{n}", 1.0, account)


async def sweep(
    m: Model, replica: str, waiters: list[tuple[str, int]] | None = None, alive: int | None = None
) -> Sweep:
    """`replica`'s sweep of the model, naming `waiters` (id, place) if given; `alive`: the
    score its last sweep wrote, if known."""
    reply = await m.run(m.slots.sweep([], waiters or [], [], replica, alive))
    return sweep_result(reply)


async def queue_up(m: Model, ids: list[str]) -> dict[str, int]:
    """Each id queued behind a full model: its place (rank x RANK + sequence). In order,
    but for runs of 50 (sent at once: in any order among themselves)."""
    places = {}
    for start in range(0, len(ids), 50):
        chunk = ids[start : start + 50]
        if len(chunk) < 50:
            got = [await m.acquire(i, may_wait=True) for i in chunk]
        else:
            got = await asyncio.gather(*(m.acquire(i, may_wait=True) for i in chunk))
        for i, a in zip(chunk, got, strict=True):
            places[i] = Tier.DEFAULT.rank * RANK + a.place
    return places


async def bury_now(m: Model, replica: str) -> None:
    """`replica`'s word that it is alive ends now (it died, or was stopped past it)."""
    alive = m.slots.keys[_key("alive")]
    assert await m.client.zadd(alive, {replica: 1}, xx=True, ch=True) == 1


def _key(name: str) -> int:
    return [key.name for key in MODEL].index(name)


async def test_a_dead_replicas_waiters_leave_and_no_one_elses(real_redis: aioredis.Redis) -> None:
    """Its waiters leave at the next sweep of another replica; a replica whose id starts
    with the dead one's ("r1-2" and "r1") keeps its own; so does the live one."""
    m = Model(real_redis, slots(max_queue=100))
    await m.acquire("l1")
    await m.acquire("l2")
    dead = [waiter("r1", n) for n in range(3)]
    other = [waiter("r1-2", n) for n in range(2)]
    live = [waiter("r2", n) for n in range(2)]
    await queue_up(m, [dead[0], other[0], live[0], dead[1], other[1], live[1], dead[2]])
    for replica in ("r1", "r1-2", "r2"):
        await sweep(m, replica)  # each says it is alive
    await bury_now(m, "r1")
    await sweep(m, "r2")
    assert await m.queue() == [other[0], live[0], other[1], live[1]]
    assert (await m.state())[2] == 4  # the default tier's count follows
    alive = {text(r) for r in await real_redis.zrange(m.slots.keys[_key("alive")], 0, -1)}
    assert alive == {"r1-2", "r2"}
    await m.release(*other, *live, "l1", "l2")
    await m.sweep()
    assert await m.queue() == [] and await real_redis.zcard(m.slots.keys[_key("qexp")]) == 0


async def test_a_replica_back_after_its_waiters_left_is_told_to_name_them(
    real_redis: aioredis.Redis,
) -> None:
    """Stopped past the waiter TTL: its waiters left. Its next sweep is told so (`name`),
    and the sweep naming them queues them again at their places, ahead of later ones."""
    m = Model(real_redis, slots(max_queue=100))
    await m.acquire("l1")
    await m.acquire("l2")
    mine = [waiter("r1", n) for n in range(2)]
    later = waiter("r2", 0)
    places = await queue_up(m, mine)
    first = await sweep(m, "r1")
    assert not first.name  # its acquires wrote it alive (prelude `live`): nothing was lost
    assert not (await sweep(m, "r1")).name
    await bury_now(m, "r1")
    await sweep(m, "r2")
    assert await m.queue() == []
    await queue_up(m, [later])
    back = await sweep(m, "r1")
    assert back.name
    named = await sweep(m, "r1", [(w, places[w]) for w in mine])
    assert named.requeued == mine and named.granted == ["", ""]
    assert await m.queue() == [*mine, later]
    assert not (await sweep(m, "r1")).name
    await m.release(*mine, later, "l1", "l2")


async def test_a_replica_killed_before_its_first_sweep_leaves_no_waiter_behind(
    real_redis: aioredis.Redis,
) -> None:
    """Its acquires wrote it alive for the waiter TTL (it never swept the model): once that
    is past, another replica's sweep takes its waiters out. A waiter writes nothing of its
    own: `qexp` stays empty."""
    m = Model(real_redis, slots(max_queue=100))
    await m.acquire("l1")
    await m.acquire("l2")
    mine = [waiter("r1", n) for n in range(3)]
    await queue_up(m, mine)
    assert await real_redis.zcard(m.slots.keys[_key("qexp")]) == 0
    await sweep(m, "r2")
    assert await m.queue() == mine  # alive still
    await bury_now(m, "r1")  # killed: its word runs out
    await sweep(m, "r2")
    assert await m.queue() == []
    await m.release("l1", "l2")


async def test_the_replicas_word_lasts_while_anyone_waits_though_every_replica_is_gone(
    real_redis: aioredis.Redis,
) -> None:
    """Every replica gone longer than the key's own life (a crash loop, a redeploy): their
    entries in `alive` must still be there for the next replica's sweep to find their
    waiters by; once nobody waits, the key expires."""
    m = Model(real_redis, slots(max_queue=100))
    await m.acquire("l1")
    await m.acquire("l2")
    await sweep(m, "r1")  # nobody waits yet: the key expires in a while
    mine = [waiter("r1", n) for n in range(2)]
    await queue_up(m, mine)  # (r1 known alive: its acquires write nothing there but this)
    alive = m.slots.keys[_key("alive")]
    assert await real_redis.pttl(alive) > DAY_MS / 2  # a day while anyone waits
    await sweep(m, "r1")
    assert await real_redis.pttl(alive) > DAY_MS / 2
    await bury_now(m, "r1")  # r1 died; nothing swept for long
    await sweep(m, "r2")
    assert await m.queue() == []
    await sweep(m, "r2")
    assert 0 < await real_redis.pttl(alive) <= 10 * m.slots._timing.waiter_ttl_ms
    await m.release("l1", "l2")


async def test_a_sweep_that_does_not_find_its_last_score_names_the_waiters(
    real_redis: aioredis.Redis,
) -> None:
    """The score a sweep wrote in `alive`, found by the next, says nothing written before
    was lost; another score (a failover lost that sweep: an older one is there) says to
    name every waiter."""
    m = Model(real_redis, slots(max_queue=100))
    ttl = m.slots._timing.waiter_ttl_ms
    first = await sweep(m, "r1")
    second = await sweep(m, "r1", alive=first.clock_ms + ttl)
    assert not second.name
    lagged = await sweep(m, "r1", alive=second.clock_ms + ttl + 1)  # not what Redis holds
    assert lagged.name
    assert not (await sweep(m, "r1", alive=lagged.clock_ms + ttl)).name


async def test_redis_restarted_empty_tells_every_replica_to_name_its_waiters(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots(max_queue=100))
    await sweep(m, "r1")
    assert not (await sweep(m, "r1")).name
    await real_redis.flushdb()
    assert (await sweep(m, "r1")).name
    assert not (await sweep(m, "r1")).name


@pytest.mark.slow
async def test_a_long_queue_is_looked_through_over_several_sweeps(
    real_redis: aioredis.Redis,
) -> None:
    """A dead replica's 6,000 waiters behind 1,000 of a live one: more than one sweep looks
    through (5,000 entries a call at most, about 2 ms), all leave within two sweeps, and the
    live replica's stay in order. (Waiters live a minute here: queueing 7,000 takes seconds
    on a busy machine, and a live replica's word that it is alive must outlast it.)"""
    timing = dataclasses.replace(TIMING, waiter_ttl_ms=60_000)
    m = Model(real_redis, slots(max_queue=10_000, timing=timing))
    await m.acquire("l1")
    await m.acquire("l2")
    live = [waiter("r2", n) for n in range(1000)]
    dead = [waiter("r1", n) for n in range(6000)]
    await queue_up(m, [*live, *dead])
    await sweep(m, "r1")
    await sweep(m, "r2")
    await bury_now(m, "r1")
    await sweep(m, "r2")
    assert 1000 < len(await m.queue()) < 7000  # not all in one call
    await sweep(m, "r2")
    assert sorted(await m.queue()) == sorted(live)
    alive = {text(r) for r in await real_redis.zrange(m.slots.keys[_key("alive")], 0, -1)}
    assert alive == {"r2"} and not await real_redis.exists(m.slots.keys[_key("gone")])
    await m.release(*live, "l1", "l2")


async def test_a_sweep_naming_no_waiter_costs_nothing_per_waiter(
    real_redis: aioredis.Redis,
) -> None:
    """With 2,000 waiters queued, a sweep that names none costs Redis a few calls, none
    per waiter: their `qexp` entries are not touched."""
    m = Model(real_redis, slots(max_queue=5000))
    await m.acquire("l1")
    await m.acquire("l2")
    await queue_up(m, [waiter("r1", n) for n in range(2000)])
    await sweep(m, "r1")
    qexp = m.slots.keys[_key("qexp")]
    before = await real_redis.zrange(qexp, 0, -1, withscores=True)
    stats: list[dict[str, Any]] = []
    stats.append(await real_redis.info("commandstats"))
    await sweep(m, "r1")
    stats.append(await real_redis.info("commandstats"))
    assert await real_redis.zrange(qexp, 0, -1, withscores=True) == before

    def calls(i: int) -> int:
        return sum(int(v.get("calls", 0)) for v in stats[i].values() if isinstance(v, dict))

    assert calls(1) - calls(0) < 60


async def test_after_lost_writes_a_sweep_takes_out_what_its_replica_no_longer_holds(
    real_redis: aioredis.Redis,
) -> None:
    """A failover that lost writes brings back a lease r1 had released and a waiter it had
    taken back: r1's sweep naming all it holds (`purge`: the number its ids reached, its
    walks under way) takes both out and hands the slot on, within the same call. What it
    holds stays; so do another replica's ids, one issued after the sweep left, and a walk
    under way."""
    m = Model(real_redis, slots(max_queue=100))
    held, ghost = waiter("r1", 1), waiter("r1", 2)
    on = {i: (await m.acquire(i)).endpoint for i in (held, ghost)}
    gone, named, other, later, walking = (
        waiter("r1", 3), waiter("r1", 4), waiter("r2", 0), waiter("r1", 9), waiter("r1", 5),
    )  # fmt: skip
    places = await queue_up(m, [gone, named, other, walking, later])
    reply = await m.run(
        m.slots.sweep([(held, on[held])], [(named, places[named])], [], "r1", None, (8, [walking]))
    )
    found = sweep_result(reply)
    assert found.purged == 2
    assert await m.leases() == {held, named}  # the freed slot went to the head: r1-4
    assert await m.queue() == [other, walking, later]
    assert (await m.state())[:3] == [2, 0, 3]
    await m.release(held, named, other, walking, later)


@pytest.mark.parametrize("one_redis", [True, False], ids=["one-redis", "cluster-keys"])
async def test_a_dead_replicas_waiter_and_lease_take_their_account_entries(
    real_redis: aioredis.Redis, one_redis: bool
) -> None:
    """On one Redis a waiter buried and a lease reclaimed after their replica died take
    their entries in the account's count with them, in the same call (prelude
    `drop_entry`): the keeps write entries to outlive the leases by up to a third of the
    TTL, and a limited account would be refused that long for requests no one runs. Given
    a Cluster's keys (every key of the model: the account's lives on another node) the
    sweeps never touch it; there every account is kept at every round."""
    m = Model(real_redis, slots(((A_URL, 1),), declare_all=not one_redis))
    key, other = account_key("t-dead"), account_key("t-live")
    lease, queued, theirs = (
        waiter("r1", 1, "t-dead"),
        waiter("r1", 2, "t-dead"),
        waiter("r2", 1, "t-live"),
    )
    for lease_id, akey, wait in ((lease, key, False), (queued, key, True), (theirs, other, True)):
        if one_redis:  # (acquire takes the entry itself; on a Cluster account.lua does)
            await m.run(m.slots.acquire(lease_id, Tier.DEFAULT, may_wait=wait, account=(akey, 5)))
        else:
            await m.run(("account", [akey], [lease_id, 5, TIMING.lease_ttl_ms]))
            await m.run(m.slots.acquire(lease_id, Tier.DEFAULT, may_wait=wait))
    assert await m.leases() == {lease} and await m.queue() == [queued, theirs]
    for replica in ("r1", "r2"):
        await sweep(m, replica)
    await bury_now(m, "r1")
    await sweep(m, "r2")
    assert await m.queue() == [theirs]
    entries = {text(e) for e in await real_redis.zrange(key, 0, -1)}
    assert entries == ({lease} if one_redis else {lease, queued})
    await m.expire_lease(lease)
    await sweep(m, "r2")
    assert await m.leases() == {theirs}  # r1's slot went to r2's waiter
    left = {text(e) for e in await real_redis.zrange(key, 0, -1)}
    assert left == (set() if one_redis else {lease, queued})
    assert {text(e) for e in await real_redis.zrange(other, 0, -1)} == {theirs}
    await real_redis.delete(key, other)
