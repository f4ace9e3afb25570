"""Fair share's counts (`held`: prelude `counting`) are kept while someone waits and for a
while after the queue empties (sweep.lua `settle_counting`): a model at its capacity whose
queue comes and goes counts its leases afresh (O(leases)) once, not each time a request
queues behind an empty queue. While kept, every path counts, the common ones too."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from routing.admission.slots import BUSY, GRANTED, QUEUED, make_lease_id
from routing.store.wire import text
from tests.routing.admission.test_slots import Model, slots

pytestmark = pytest.mark.usefixtures("script_modes")

KEEP_MS = 10_000  # sweep.lua KEEP_MS


def lid(name: str, account: str) -> str:
    return make_lease_id(f"r-{name}", 1, account)


def acct(account: str) -> str:
    """The account as a lease id carries it (a digest)."""
    return lid("x", account).rsplit("~", 1)[1]


class Counts:
    def __init__(self, m: Model) -> None:
        self.m, self.r = m, m.client
        tag = m.slots.keys[0][: -len("leases")]
        self.held_key, self.load_key = tag + "held", tag + "ep_load"

    async def held(self) -> dict[str, int]:
        return {text(k): int(v) for k, v in (await self.r.hgetall(self.held_key)).items()}

    async def kept(self) -> bool:
        return int(text(await self.r.hget(self.load_key, "~f") or b"0")) % 2 == 1

    async def emptied_at(self) -> int | None:
        found = await self.r.hget(self.load_key, "~e")
        return None if found is None else int(text(found))


async def test_counts_outlive_the_queue_and_follow_every_lease(
    real_redis: aioredis.Redis,
) -> None:
    m = Model(real_redis, slots())
    c = Counts(m)
    x1, y1, z1, x2 = lid("x1", "x"), lid("y1", "y"), lid("z1", "z"), lid("x2", "x")
    assert (await m.acquire(x1)).status == GRANTED
    assert (await m.acquire(y1)).status == GRANTED
    assert not await c.kept()
    assert (await m.acquire(z1, may_wait=True)).status == QUEUED  # counted afresh: x 1, y 1
    assert await c.held() == {acct("x"): 1, acct("y"): 1}
    assert await m.release(x1) == 1  # handed to z1: the queue is empty, the counts stay
    assert await m.queue() == []
    assert await c.kept() and await c.held() == {acct("y"): 1, acct("z"): 1}
    assert await m.release(y1) == 0  # nobody waits: counted back all the same
    assert (await m.acquire(x2)).status == GRANTED  # and counted
    assert await c.held() == {acct("z"): 1, acct("x"): 1}
    await m.sweep()  # the queue found empty: from now on
    since = await c.emptied_at()
    assert since is not None and await c.kept()
    await m.sweep()  # still within KEEP_MS of it
    assert await c.emptied_at() == since and await c.kept()
    await real_redis.hset(c.load_key, "~e", since - KEEP_MS)  # as if KEEP_MS went by
    await m.sweep()
    assert not await c.kept()
    assert await c.held() == {} and await c.emptied_at() is None
    assert (await m.acquire(lid("y2", "y"))).status == BUSY  # full: z1 and x2 hold both
    w = lid("w", "y")
    assert (await m.acquire(w, may_wait=True)).status == QUEUED  # counted afresh
    assert await c.kept() and await c.held() == {acct("z"): 1, acct("x"): 1}


async def test_a_request_queued_behind_an_empty_queue_counts_nothing_afresh(
    real_redis: aioredis.Redis,
) -> None:
    """A full model, its queue going from empty to one waiter and back again and again: the
    counts made once are kept (a count afresh would drop the mark left in them)."""
    m = Model(real_redis, slots())
    c = Counts(m)
    held = [lid("a1", "a"), lid("b1", "b")]
    for lease in held:
        assert (await m.acquire(lease)).status == GRANTED
    assert (await m.acquire(lid("w0", "w"), may_wait=True)).status == QUEUED
    await real_redis.hset(c.held_key, "mark", 7)  # gone if the counts were made afresh
    for i in range(1, 6):
        assert await m.release(held.pop(0)) == 1  # hands the slot to the only waiter
        assert await m.queue() == []
        held.append(lid(f"w{i - 1}", "w"))
        assert (await m.acquire(lid(f"w{i}", "w"), may_wait=True)).status == QUEUED
    assert (await c.held())["mark"] == 7
    assert (await c.held())[acct("w")] == 2


async def test_a_queue_found_empty_again_after_waiting_keeps_counting(
    real_redis: aioredis.Redis,
) -> None:
    """A sweep that finds someone waiting forgets when the queue was last found empty: the
    counts are kept KEEP_MS from the next time it is."""
    m = Model(real_redis, slots())
    c = Counts(m)
    a1, b1 = lid("a1", "a"), lid("b1", "b")
    await m.acquire(a1)
    await m.acquire(b1)
    assert (await m.acquire(lid("w", "w"), may_wait=True)).status == QUEUED
    await real_redis.hset(c.load_key, "~e", 1)  # an old mark, from before the queue formed
    await m.sweep()  # someone waits: kept, the mark gone
    assert await c.kept() and await c.emptied_at() is None
    assert await m.release(a1) == 1
    await m.sweep()
    assert await c.kept() and await c.emptied_at() is not None
