"""The keeper's naming of its waiters when Redis did not know the replica alive, against a
round where some other call failed (a Cluster node failing over, a key of another type):
the waiters Redis lost still go back to their places within the round, or the next."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from routing.store.wire import text
from tests.routing.admission.test_admission import Fleet, bounded, fill, intercept, release_all
from tests.routing.admission.test_keeper_accounts import restore, snapshot
from tests.routing.admission.test_keeper_naming import (
    LOSSES,
    Named,
    a_waiter,
    fleet,
    lose,
    not_naming,
    queued_waiter,
)

__all__ = ["fleet"]


def failing_heartbeat(adm: Any) -> None:
    """The next round's heartbeat answered by an error (its node failing over): once."""
    left = [1]

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        replies = await send()
        if left[0] and any(name == "heartbeat" for name, _, _ in calls):
            left[0] = 0
            at = [name for name, _, _ in calls].index("heartbeat")
            replies[at] = ResponseError("TRYAGAIN the heartbeat's node fails over")
        return replies

    intercept(adm, around)


@pytest.mark.parametrize("lost", LOSSES)
async def test_waiters_lost_go_back_though_another_call_of_the_round_failed(
    fleet: Fleet, real_redis: aioredis.Redis, lost: str
) -> None:
    """The round that finds Redis did not know the replica alive has another call fail:
    its sweeps wrote the replica alive, so no later round is told to name the waiters; they
    must be named in that round all the same (before, they stayed out of the queue until
    a NAME_EVERY round: a later request took their turn)."""
    holder, waiting = await fleet.admission(), await fleet.admission()
    keeper = await fleet.keeper(waiting)
    other = await fleet.keeper(holder)
    named = Named(waiting)
    held = await fill(fleet, holder, "two", 2)
    task, waiter_id = await queued_waiter(fleet, waiting, named)
    await bounded(keeper.sweep_once())
    await lose(fleet, real_redis, lost, waiting, other)
    failing_heartbeat(waiting)
    not_naming(keeper)
    with pytest.raises(ResponseError):
        await keeper.sweep_once()  # Redis said: name them; another call failed
    assert keeper._rounds % 5 != 0
    await bounded(keeper.sweep_once())  # the next round (not one that names anyway)
    first = [text(m) for m in await real_redis.zrange("gw:v2:{two}:queue", 0, 0)]
    in_queue = first == [waiter_id]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await bounded(waiting.drain())
    await release_all(holder, held)
    assert in_queue, "the waiter Redis lost was never queued again"


async def test_naming_at_once_keeps_the_round_owed_to_a_new_subscription(
    fleet: Fleet, real_redis: aioredis.Redis
) -> None:
    """The subscription (re)started: the next round names the waiters too (a wake-up
    published before the subscription was made in Redis is lost). A naming at once in the
    meantime (Redis did not know the replica alive in a model) must not cancel that round."""
    scene = await a_waiter(fleet)
    keeper = scene.keeper
    not_naming(keeper)
    keeper.wakeups.gaps += 1  # the subscription started again
    await bounded(keeper.sweep_once())  # names; one round more is owed
    await real_redis.zadd("gw:v2:{two}:alive", {scene.waiting.replica_id: 1}, xx=True)
    await bounded(keeper._name_now(["two"]))  # as a round told so would
    await bounded(keeper.sweep_once())
    owed = scene.waiter_id in scene.named.rounds[-1]
    await scene.end(fleet)
    assert owed, "the round owed to the new subscription named nobody"


async def test_a_new_waiter_is_named_once_at_the_next_round(fleet: Fleet) -> None:
    """A waiter queued between namings of every waiter is named by the round after, once:
    what a failover may lose unseen is what was queued since the last sweep."""
    scene = await a_waiter(fleet)  # its first round named it
    keeper, named = scene.keeper, scene.named
    not_naming(keeper)
    await bounded(keeper.sweep_once())
    assert scene.waiter_id not in named.rounds[-1]
    task, second = await queued_waiter(fleet, scene.waiting, named)
    await bounded(keeper.sweep_once())
    assert named.rounds[-1] == {second}
    await bounded(keeper.sweep_once())
    assert named.rounds[-1] == set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await scene.end(fleet)


@pytest.mark.parametrize("lagged", ["before the new waiter's round", "before its acquire"])
async def test_a_failover_that_lost_the_last_writes_has_the_new_waiter_queued_again(
    fleet: Fleet, real_redis: aioredis.Redis, lagged: str
) -> None:
    """A failover to a replica that lagged behind: Redis lost a new waiter's place, and
    perhaps the sweep that named it, but still knows this replica alive by an older sweep.
    The next round finds its last score missing (it names every waiter at once), or the
    waiter new since: the waiter is queued again at its place, first."""
    scene = await a_waiter(fleet)
    keeper, named = scene.keeper, scene.named
    not_naming(keeper)
    await bounded(keeper.sweep_once())
    lagged_state = await snapshot(real_redis)  # what the replica that takes over holds
    task, second = await queued_waiter(fleet, scene.waiting, named)
    if lagged == "before the new waiter's round":
        await bounded(keeper.sweep_once())  # names it, writes this replica alive again
    await restore(real_redis, lagged_state)  # the failover
    assert second not in await queue_of(real_redis)
    await bounded(keeper.sweep_once())
    assert await queue_of(real_redis) == [scene.waiter_id, second]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await scene.end(fleet)


async def queue_of(client: aioredis.Redis) -> list[str]:
    return [text(m) for m in await client.zrange("gw:v2:{two}:queue", 0, -1)]


async def test_a_loss_found_by_a_round_that_names_a_new_waiter_names_the_older_ones_too(
    fleet: Fleet, real_redis: aioredis.Redis
) -> None:
    """The replica was away past the waiter TTL and its waiters were taken out; on its
    return a new waiter queues first. Its next round names that one alone, and its sweep
    finds the loss: the older waiter must be named too, at once, back at its place first
    (not left out of the queue until a round that names everyone)."""
    scene = await a_waiter(fleet, listen=True)  # its first round named it
    waiting, keeper, named, older = scene.waiting, scene.keeper, scene.named, scene.waiter_id
    other = await fleet.keeper(scene.holder)
    not_naming(keeper)
    await real_redis.zadd("gw:v2:{two}:alive", {waiting.replica_id: 1}, xx=True)  # away
    await bounded(other.sweep_once())  # takes its waiter out as a dead replica's
    assert await queue_of(real_redis) == []
    later, newer = await queued_waiter(fleet, waiting, named)  # back: a new waiter first
    await bounded(keeper.sweep_once())  # names the new one; finds the loss
    assert await queue_of(real_redis) == [older, newer]
    later.cancel()
    await asyncio.gather(later, return_exceptions=True)
    await scene.end(fleet)
