"""When the keeper's sweeps name this replica's waiters (routing/admission/naming.py): once
at the round after each queued, all every NAME_EVERY rounds and at once when Redis may have
lost them; between, a waiter costs the sweeps nothing, and a wake-up is trusted by the time
its grant says (routing/admission/wakeups.py). Against the run's Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.runtime.settings import parse_config
from routing.admission.admit import Admission, Admitted, Lease
from routing.admission.keeper import Keeper
from routing.admission.timing import NAME_EVERY
from routing.registry import Registry
from routing.store.wire import text
from tests.routing.admission.test_admission import (
    CONFIG,
    Fleet,
    admit,
    bounded,
    fill,
    intercept,
    release_all,
    running,
)

WAIT_S = 20.0


@pytest.fixture(params=["resp"])  # (the keeper's logic; test_admission runs both clients)
async def fleet(real_redis: aioredis.Redis, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    """test_admission's fleet, its waiters waiting long enough for several rounds."""
    config = parse_config(
        CONFIG.replace("queue_timeout_s: 0.5", f"queue_timeout_s: {WAIT_S}"), "t.yaml"
    )
    async with running(Fleet(config, Registry(config.models), real_redis, request.param)) as f:
        yield f


class Named:
    """The waiter ids each sweep of a replica named, and the calls it sent."""

    def __init__(self, adm: Admission) -> None:
        self.rounds: list[set[str]] = []
        self.cancels = 0
        self.queued: asyncio.Queue[str] = asyncio.Queue()
        intercept(adm, self._around)

    async def _around(
        self, calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]
    ) -> list[Any]:
        sweeps = [args for name, _, args in calls if name == "sweep"]
        if sweeps:
            self.rounds.append({str(a) for args in sweeps for a in args if "~" in str(a)})
        self.cancels += sum(name == "cancel" for name, _, _ in calls)
        replies = await send()
        for (name, _, args), reply in zip(calls, replies, strict=True):
            if name == "acquire" and isinstance(reply, list) and int(reply[0]) == 2:
                self.queued.put_nowait(str(args[0]))
        return replies


async def queued_waiter(fleet: Fleet, adm: Admission, named: Named) -> tuple[Any, str]:
    """A request of `adm` waiting in the queue of "two" (full), its place known to its
    replica (so its sweeps may name it)."""
    placed, wait = asyncio.Event(), adm.waiting.wait

    async def waits(lease_id: str, place: int, timeout_s: float) -> str | int:
        adm.holdings.waiters[lease_id].place = place  # as `wait` first does
        placed.set()
        return await wait(lease_id, place, timeout_s)

    adm.waiting.wait = waits  # type: ignore[method-assign]
    task = asyncio.create_task(admit(adm, fleet.plan("two"), account="t-w"))
    waiter_id = await bounded(named.queued.get())
    await bounded(placed.wait())
    return task, waiter_id


@dataclass
class Scene:
    """Two replicas: `holder` fills "two", `waiting`'s request waits in its queue (`task`,
    as `waiter_id`), its keeper's first round already run (it named the waiter)."""

    holder: Admission
    waiting: Admission
    keeper: Keeper
    named: Named
    held: list[Lease]
    task: asyncio.Task[Admitted]
    waiter_id: str

    async def end(self, fleet: Fleet) -> None:
        """The waiter gives up, the holder's leases go back: nothing left."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await bounded(self.waiting.drain())
        await release_all(self.holder, self.held)


async def a_waiter(fleet: Fleet, *, listen: bool = False) -> Scene:
    holder, waiting = await fleet.admission(), await fleet.admission()
    keeper = await fleet.keeper(waiting, listen=listen)
    named = Named(waiting)
    held = await fill(fleet, holder, "two", 2)
    task, waiter_id = await queued_waiter(fleet, waiting, named)
    await bounded(keeper.sweep_once())
    return Scene(holder, waiting, keeper, named, held, task, waiter_id)


def not_naming(keeper: Keeper) -> None:
    """The keeper as between namings: its subscription's start answered, no round due."""
    keeper.naming._gaps, keeper.naming._next = keeper.wakeups.gaps, 0
    keeper.wakeups.listening = True
    keeper._rounds = 1


async def test_between_namings_a_waiter_costs_the_sweeps_nothing_and_a_lost_wake_up_waits(
    fleet: Fleet,
) -> None:
    """Rounds 1 to NAME_EVERY - 1 name no waiter; a wake-up lost meanwhile unseen (the
    subscription thought live; nobody listens) is claimed by the round that names them,
    NAME_EVERY."""
    holder, waiting = await fleet.admission(), await fleet.admission()
    keeper = await fleet.keeper(waiting, listen=False)
    keeper.wakeups.listening = True
    named = Named(waiting)
    held = await fill(fleet, holder, "two", 2)
    task, waiter_id = await queued_waiter(fleet, waiting, named)
    await bounded(keeper.sweep_once())  # round 0 names it
    await bounded(holder.release(held[0]))  # granted; its wake-up lost
    for _ in range(NAME_EVERY - 1):
        await bounded(keeper.sweep_once())
        assert not task.done()
    await bounded(keeper.sweep_once())
    admitted: Admitted = await bounded(task)
    assert [waiter_id in r for r in named.rounds] == [True] + [False] * (NAME_EVERY - 1) + [True]
    assert admitted.lease.endpoint == held[0].endpoint
    await release_all(waiting, [admitted.lease])
    await release_all(holder, held[1:])
    await fleet.assert_clean()


async def test_while_the_subscription_is_down_every_round_names(fleet: Fleet) -> None:
    """A subscription that broke backs off for seconds before it starts again: every
    wake-up meanwhile is lost, so every round names the waiters (a grant is claimed within
    a sweep, never left to go back at its claim time)."""
    holder, waiting = await fleet.admission(), await fleet.admission()
    keeper = await fleet.keeper(waiting, listen=False)
    named = Named(waiting)
    held = await fill(fleet, holder, "two", 2)
    task, waiter_id = await queued_waiter(fleet, waiting, named)
    not_naming(keeper)
    keeper.wakeups.listening = False  # broken, backing off
    await bounded(holder.release(held[0]))  # granted; its wake-up lost
    await bounded(keeper.sweep_once())
    admitted: Admitted = await bounded(task)
    assert [waiter_id in r for r in named.rounds] == [True]
    await release_all(waiting, [admitted.lease])
    await release_all(holder, held[1:])
    await fleet.assert_clean()


async def test_a_round_that_failed_or_a_new_subscription_names_at_the_next_rounds(
    fleet: Fleet,
) -> None:
    holder, waiting = await fleet.admission(), await fleet.admission()
    keeper = await fleet.keeper(waiting, listen=False)
    named = Named(waiting)
    held = await fill(fleet, holder, "two", 2)
    task, waiter_id = await queued_waiter(fleet, waiting, named)
    await bounded(keeper.sweep_once())  # the first: names, and it is known alive
    not_naming(keeper)
    await bounded(keeper.sweep_once())
    keeper.wakeups.gaps += 1  # the subscription started again: wake-ups may be lost
    await bounded(keeper.sweep_once())
    await bounded(keeper.sweep_once())
    await bounded(keeper.sweep_once())
    assert [waiter_id in r for r in named.rounds] == [True, False, True, True, False]
    broken = waiting.scripts.send

    def failing(store: Any, calls: Sequence[Any]) -> Any:
        waiting.scripts.send = broken  # type: ignore[method-assign]
        raise ConnectionError("the round's connection broke")

    waiting.scripts.send = failing  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        await keeper.sweep_once()
    await bounded(keeper.sweep_once())
    assert waiter_id in named.rounds[-1]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await bounded(waiting.drain())
    await release_all(holder, held)
    await fleet.assert_clean()


LOSSES = ["redis restarted empty", "replica away past the waiter TTL"]


async def lose(
    fleet: Fleet, redis: aioredis.Redis, lost: str, waiting: Admission, other: Keeper
) -> None:
    """`waiting`'s waiters lost (`lost`, one of LOSSES) as `other`'s next sweep finds it:
    Redis restarted empty (the sweep writes back what its replica holds), or `waiting` was
    away past the waiter TTL (the sweep takes its waiters out of the queue)."""
    if lost == "redis restarted empty":
        await redis.flushdb()
        await bounded(other.sweep_once())
    else:
        await redis.zadd("gw:v2:{two}:alive", {waiting.replica_id: 1}, xx=True)
        await bounded(other.sweep_once())
        assert await fleet.queued("two") == 0  # taken out as a dead replica's


@pytest.mark.slow
@pytest.mark.parametrize("lost", LOSSES)
async def test_waiters_redis_lost_are_queued_again_in_the_same_round(
    fleet: Fleet, real_redis: aioredis.Redis, lost: str
) -> None:
    """On a round that names nobody, the sweep finds Redis did not know the replica alive
    (an empty restart; or it was stopped past the waiter TTL and another replica's sweep
    took its waiters out): the same round names them, queued again at their places ahead
    of a later waiter, and the first to be granted is the oldest."""
    holder, waiting = await fleet.admission(), await fleet.admission()
    keeper = await fleet.keeper(waiting)
    other = await fleet.keeper(holder)
    named, holder_named = Named(waiting), Named(holder)
    held = await fill(fleet, holder, "two", 2)
    task, waiter_id = await queued_waiter(fleet, waiting, named)
    await bounded(keeper.sweep_once())
    await lose(fleet, real_redis, lost, waiting, other)
    later = asyncio.create_task(admit(holder, fleet.plan("two"), account="t-later"))
    await bounded(holder_named.queued.get())  # (after the rebuild window: 3.5 s)
    await bounded(other.sweep_once())  # its replica alive meanwhile
    not_naming(keeper)
    await bounded(keeper.sweep_once())
    assert waiter_id in named.rounds[-1]  # named in the same round (a second call)
    assert await fleet.queued("two") == 2
    first = "gw:v2:{two}:queue"
    assert [text(m) for m in await real_redis.zrange(first, 0, 0)] == [waiter_id]
    await real_redis.delete("gw:v2:{two}:rebuild")  # the rebuild window over
    await bounded(holder.release(held[0]))
    admitted: Admitted = await bounded(task)
    assert admitted.lease.id == waiter_id
    await bounded(holder.release(held[1]))
    after: Admitted = await bounded(later)
    await release_all(waiting, [admitted.lease])
    await release_all(holder, [after.lease])
    await fleet.assert_clean()


async def test_a_wake_up_read_at_once_is_trusted_after_a_long_wait_no_sweep_named(
    fleet: Fleet,
) -> None:
    """A waiter that waited far past the trust window (its clock moved on by the claim
    time and more) with no sweep naming it: a wake-up read just after its grant says so by
    its time, and the waiter runs without asking Redis."""
    holder, waiting = await fleet.admission(), await fleet.admission()
    keeper = await fleet.keeper(waiting)
    named = Named(waiting)
    held = await fill(fleet, holder, "two", 2)
    task, waiter_id = await queued_waiter(fleet, waiting, named)
    await bounded(keeper.sweep_once())  # names it once (the round after it queued)
    later_s = 2 * waiting.timing.claim_ms / 1000
    waiting.waiting.clock = lambda: time.monotonic() + later_s  # waited that much longer
    not_naming(keeper)
    await bounded(keeper.sweep_once())  # tells Redis's clock against this replica's
    assert waiter_id not in named.rounds[-1]
    await bounded(holder.release(held[0]))
    admitted: Admitted = await bounded(task)
    assert admitted.lease.endpoint == held[0].endpoint
    assert named.cancels == 0  # trusted: no call to Redis to ask
    await release_all(waiting, [admitted.lease])
    await release_all(holder, held[1:])
    await fleet.assert_clean()


async def test_a_wake_up_read_late_by_its_grants_time_asks_redis_first(
    fleet: Fleet, real_redis: aioredis.Redis
) -> None:
    """The same wake-up (its grant's time said), read when this replica's clock has moved
    on by the claim time since (it was stopped): the grant may have gone back, so the
    waiter asks Redis, which still holds it here, and runs."""
    scene = await a_waiter(fleet)
    holder, waiting, keeper, named, held = (scene.holder, scene.waiting, scene.keeper,
                                            scene.named, scene.held)  # fmt: skip
    task, waiter_id = scene.task, scene.waiter_id
    not_naming(keeper)
    await bounded(keeper.sweep_once())  # tells Redis's clock against this replica's
    pubsub = real_redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(waiting.slots["two"].channel)
    try:
        await bounded(holder.release(held[0]))
        message = None
        while message is None:
            message = await bounded(pubsub.get_message(timeout=1.0))
    finally:
        await pubsub.aclose()
    assert text(message["data"]).startswith("@") and waiter_id in text(message["data"])
    later_s = 2 * waiting.timing.claim_ms / 1000
    waiting.waiting.clock = lambda: time.monotonic() + later_s  # stopped that long
    keeper.wakeups.on_message(message)
    admitted: Admitted = await bounded(task)
    assert named.cancels == 1  # asked
    assert admitted.lease.endpoint == held[0].endpoint
    await release_all(waiting, [admitted.lease])
    await release_all(holder, held[1:])
    await fleet.assert_clean()
