"""A wake-up read late tells of a grant that went back: trusted or not by the grant's own
time (routing/admission/wakeups.py), whatever a later sweep found of its waiter."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import redis.asyncio as aioredis

from routing.admission.admit import Admitted
from routing.store.wire import text
from tests.routing.admission.test_admission import Fleet, admit, bounded, fill, release_all
from tests.routing.admission.test_keeper_naming import Named, fleet, queued_waiter

__all__ = ["fleet"]


async def grant_message(redis: aioredis.Redis, channel: str, release: Any) -> dict[str, Any]:
    """The wake-up `release()` publishes on `channel`, as a subscriber reads it."""
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(channel)
    try:
        await release()
        message: dict[str, Any] | None = None
        while message is None:
            message = await bounded(pubsub.get_message(timeout=1.0))
        return message
    finally:
        await pubsub.aclose()


async def test_a_stale_timed_wake_up_read_after_a_sweep_found_its_waiter_queued_again(
    fleet: Fleet, real_redis: aioredis.Redis
) -> None:
    """The waiter's replica is stopped: its waiter is granted a slot, the grant goes back
    after the claim time and another request takes the slot. Resumed, its sweeps run before
    its subscription reads the backlog: one queues the waiter again at its place (lost), the
    next finds it queued. Then the old wake-up is read: its grant's time says it is far
    older than the trust window, so the waiter must not run on that endpoint without
    asking Redis (the sweep that found it queued says nothing of a grant made before)."""
    holder, waiting = await fleet.admission(), await fleet.admission()
    keeper = await fleet.keeper(waiting, listen=False)
    sweeper = await fleet.keeper(holder, listen=False)
    named = Named(waiting)
    held = await fill(fleet, holder, "two", 2)
    task, waiter_id = await queued_waiter(fleet, waiting, named)
    await bounded(keeper.sweep_once())  # names it; Redis's clock against this replica's
    message = await grant_message(
        real_redis, waiting.slots["two"].channel, lambda: holder.release(held[0])
    )
    assert waiter_id in text(message["data"]) and text(message["data"]).startswith("@")
    member = await fleet.member("two", waiter_id)
    assert member is not None
    seconds, micros = await real_redis.time()
    past = seconds * 1000 + micros // 1000 - 1000
    await real_redis.zadd("gw:v2:{two}:leases", {member: past}, xx=True)  # its claim time over
    await bounded(sweeper.sweep_once())  # reclaimed by the other replica's sweep
    other = await admit(holder, fleet.plan("two"))
    assert other.lease.endpoint == held[0].endpoint
    stopped_s = 2 * waiting.timing.claim_ms / 1000
    waiting.waiting.clock = lambda: time.monotonic() + stopped_s  # resumed
    keeper.naming._next = 1
    await bounded(keeper.sweep_once())  # queues it again at its place, as lost
    assert await fleet.queued("two") == 1
    keeper.naming._next = 1
    await bounded(keeper.sweep_once())  # finds it queued
    keeper.wakeups.on_message(message)  # the backlog's old wake-up, read now
    await asyncio.sleep(0.1)
    running = Counter(
        lease.endpoint for adm in (holder, waiting) for lease in adm.holdings.held.values()
    )
    assert max(running.values()) <= 1, running
    assert not task.done()  # it waits on, at its place
    await real_redis.delete("gw:v2:{two}:rebuild")  # the window its queueing again opened, over
    await bounded(holder.release(other.lease))  # its next grant, found by a sweep
    keeper.naming._next = 1
    await bounded(keeper.sweep_once())
    admitted: Admitted = await bounded(task)
    assert admitted.lease.endpoint == held[0].endpoint
    await release_all(waiting, [admitted.lease])
    await release_all(holder, [held[1]])
    await fleet.assert_clean()


async def test_after_a_move_a_grant_by_the_new_masters_clock_is_not_taken_for_stale(
    fleet: Fleet, real_redis: aioredis.Redis
) -> None:
    """A sweep found the waiter queued by the old master's clock; the store moved to a
    master whose clock is 5 s behind, and grants it there. The wake-up says a time before
    the old master's: not a sign its grant went back (another clock), so the waiter runs,
    rather than leaving its grant to go back at the claim time."""
    holder, waiting = await fleet.admission(), await fleet.admission()
    keeper = await fleet.keeper(waiting, listen=False)
    named = Named(waiting)
    held = await fill(fleet, holder, "two", 2)
    task, waiter_id = await queued_waiter(fleet, waiting, named)
    await bounded(keeper.sweep_once())  # names it: found queued, by this clock
    message = await grant_message(
        real_redis, waiting.slots["two"].channel, lambda: holder.release(held[0])
    )
    when, _, rest = text(message["data"]).partition(" ")
    assert rest.startswith(waiter_id)
    behind = {**message, "data": f"@{int(when[1:]) - 5000} {rest}"}
    keeper.wakeups.moved()  # the store moved to another master (its clock is another)
    keeper.wakeups.on_message(behind)
    admitted: Admitted = await asyncio.wait_for(task, 2.0)
    assert admitted.lease.endpoint == held[0].endpoint
    await release_all(waiting, [admitted.lease])
    await release_all(holder, [held[1]])
    await fleet.assert_clean()
