"""Fair share's state kept right through random operations on one model (docs/architecture.md,
fair share): acquires of several accounts (weights 0.001 to 1000, reservations or none, every
tier), releases, cancels, dead replicas' leases, sweeps, reloads that change each tier's
`fairness` mid-queue and Redis restarted empty (written back by the sweep). After each step:
the waiters per tier, `held` (counted afresh from the leases), every account queue and one
index entry per waiting account at its oldest waiter (scored by its tier's measure once a
sweep ran); no waiter granted while one of a better tier that waited before stays queued;
once everything ends nothing of the queue is left in Redis."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import cast

import pytest
import redis.asyncio as aioredis

from routing.admission.slots import GRANTED, QUEUED, RANK, ModelSlots, make_lease_id
from routing.store.wire import text
from tests.redis_server import ScoredMembers
from tests.routing.admission.test_slots import TIMING, A, B, Model
from tiers.policy import BY_RANK, Tier

pytestmark = pytest.mark.usefixtures("script_modes")

UTIL = {Tier.PRIORITY: 1.0, Tier.DEFAULT: 1.0, Tier.FLEX: 1.0}
MODES = ["accounts", "tokens", "fifo"]
TAG = "gw:v2:{m}:"


def parse(lease: str) -> tuple[str, float, int]:
    """An id's account, weight and tokens (routing/admission/slots.py `make_lease_id`)."""
    parts = lease.split("~")
    if len(parts) == 4:
        return parts[3], float(parts[2]), int(parts[1])
    return parts[2], float(parts[1]), 0


@dataclass
class World:
    m: Model
    r: aioredis.Redis
    rnd: random.Random
    modes: dict[Tier, str]
    weights: dict[str, float]
    leases: list[str] = field(default_factory=list)
    waiters: dict[str, int] = field(default_factory=dict)
    n: int = 0
    scored: bool = True  # a sweep ran since the last reload


async def held_now(w: World, queue: dict[str, int]) -> dict[str, int]:
    held = {text(k): int(v) for k, v in (await w.r.hgetall(TAG + "held")).items()}
    want: dict[str, int] = {}
    for m in await w.r.zrange(TAG + "leases", 0, -1):
        acct, _, tok = parse(text(m).split(" ")[0])
        want[acct] = want.get(acct, 0) + 1
        if tok:
            want["t:" + acct] = want.get("t:" + acct, 0) + tok
    # Kept while someone waits, and for a while after (the sweeps forget them): exact when kept.
    counting = int(text(await w.r.hget(TAG + "ep_load", "~f") or b"0")) % 2 == 1
    assert counting or not queue
    assert held == (want if counting else {}), (held, want)
    return held


async def check_tier(w: World, rank: int, queue: dict[str, int], held: dict[str, int]) -> None:
    per: dict[str, dict[str, int]] = {}
    for waiter, place in queue.items():
        if place // RANK == rank:
            per.setdefault(parse(waiter)[0], {})[waiter] = place % RANK
    for acct, mine in per.items():
        got = cast(
            ScoredMembers, await w.r.zrange(f"{TAG}fq:{rank}:{acct}", 0, -1, withscores=True)
        )
        assert {text(k): int(v) for k, v in got} == mine, (rank, acct)
    index = cast(ScoredMembers, await w.r.zrange(f"{TAG}fi:{rank}", 0, -1, withscores=True))
    entries = {text(k)[16:]: (int(text(k)[:16]), v) for k, v in index}
    assert len(entries) == len(index) and set(entries) == set(per), (rank, index, per)
    mode = w.modes[BY_RANK[rank]]
    for acct, (seq, score) in entries.items():
        assert seq == min(per[acct].values())
        measure = held.get(("t:" if mode == "tokens" else "") + acct, 0)
        if w.scored and mode != "fifo":
            weight = parse(next(iter(per[acct])))[1]
            assert score == pytest.approx(measure / weight), (rank, acct, mode)


async def check(w: World) -> None:
    raw = cast(ScoredMembers, await w.r.zrange(TAG + "queue", 0, -1, withscores=True))
    queue = {text(k): int(v) for k, v in raw}
    load = {text(k): text(v) for k, v in (await w.r.hgetall(TAG + "ep_load")).items()}
    for rank in range(3):
        assert int(load.get(f"~w{rank}", 0)) == sum(1 for p in queue.values() if p // RANK == rank)
        await check_tier(w, rank, queue, await held_now(w, queue))
    assert {text(k) for k in await w.r.zrange(TAG + "qexp", 0, -1)} == set(queue)
    fair_keys = {text(k) for k in await w.r.keys(TAG + "f[qi]:*")}
    for key in fair_keys:
        assert await w.r.zcard(key) > 0


async def acquire(w: World) -> None:
    w.n += 1
    acct = w.rnd.choice(list(w.weights))
    tier = w.rnd.choice(list(Tier))
    lease = make_lease_id(f"r{w.n}", w.weights[acct], acct, w.rnd.choice([0, 10, 500, 1000]))
    got = await w.m.acquire(lease, tier, may_wait=True)
    if got.status == GRANTED:
        w.leases.append(lease)
    elif got.status == QUEUED:
        w.waiters[lease] = tier.rank * RANK + abs(got.place)


async def restart(w: World) -> None:
    """Redis restarted empty: this replica's sweep writes back what it holds."""
    held = []
    for lease in w.leases:
        if (member := await w.m.member(lease)) is not None:
            held.append((lease, member.split(" ")[1]))
    await w.r.flushdb()
    await w.m.sweep(leases=held, waiters=list(w.waiters.items()))
    await w.r.delete(w.m.slots.keys[7])  # the rebuild window is over
    await w.m.sweep(leases=held, waiters=list(w.waiters.items()))


async def other(w: World, op: float) -> None:
    if op < 0.82 and w.waiters:
        waiter = w.rnd.choice(list(w.waiters))
        del w.waiters[waiter]
        if await w.m.cancel(waiter):  # granted meanwhile: given back
            await w.m.release(waiter)
    elif op < 0.88:
        w.modes[w.rnd.choice(list(Tier))] = w.rnd.choice(MODES)
        w.m.slots.configure(UTIL, 1000, dict(w.modes))
        w.scored = False
    elif op < 0.92 and w.leases:
        await w.m.expire_lease(w.leases.pop(w.rnd.randrange(len(w.leases))))
    elif op < 0.95:
        await restart(w)
        w.scored = True
    else:
        await w.m.sweep(waiters=list(w.waiters.items()))
        w.scored = True


async def step(w: World) -> None:
    before, waited = await w.m.leases(), set(await w.m.queue())
    op = w.rnd.random()
    if op < 0.45:
        await acquire(w)
    elif op < 0.75 and w.leases:
        await w.m.release(w.leases.pop(w.rnd.randrange(len(w.leases))))
    else:
        await other(w, op)
    still = [await w.r.zscore(TAG + "queue", q) for q in waited]
    for granted in (await w.m.leases()) - before:
        if granted in w.waiters:
            rank = w.waiters.pop(granted) // RANK
            w.leases.append(granted)
            assert all(p // RANK >= rank for p in still if p is not None), granted


@pytest.mark.parametrize("seed", range(6))
async def test_fair_state_stays_right(real_redis: aioredis.Redis, seed: int) -> None:
    rnd = random.Random(seed)
    modes = {t: rnd.choice(MODES) for t in Tier}
    made = ModelSlots("m", UTIL, 1000, TIMING, dict(modes))
    made.set_endpoints([(A, 2, 0.0, 3000), (B, 2, 0.0, 3000)])
    weights = {f"acc{i}": w for i, w in enumerate((0.001, 1, 3, 1000))}
    w = World(Model(real_redis, made), real_redis, rnd, modes, weights)
    for _ in range(120):
        await step(w)
        await check(w)
    for lease in [*w.leases, *w.waiters, *await w.m.leases()]:
        await w.m.release(lease)
    await w.m.sweep()
    assert await w.m.leases() == set() and await w.m.queue() == []
    left = [text(k) for k in await real_redis.keys(TAG + "*")]
    assert not [
        k for k in left if k.split(":")[-1] in ("held", "qexp") or ":fq:" in k or ":fi:" in k
    ], left
