"""Wake-ups: a grant to a waiter of this replica, announced on its model's channel.

A grant says when it was made, by Redis's clock ("@<ms> <waiter> <endpoint>", prelude
`grant_head`). Each sweep's reply tells Redis's clock against this replica's (`saw_clock`),
so a wake-up read here tells the waiter the earliest moment (this replica's clock) the grant
can have been made: read well within the claim time, the grant is used without asking Redis
(routing/admission/waiting.py `wait`), though no sweep named the waiter meanwhile. A grant
without its time (a replica of an older release made it) is trusted from the last call that
found its waiter queued, as before.

The subscription is the only way wake-ups come between the sweeps that name the waiters, so
each time it starts (first, or again after it broke and wake-ups may have been lost) the
keeper's next sweeps name them (`gaps`). A connection can also stop without a word (a host
gone, a network that drops everything, a Redis stalled): the subscription pings Redis every
PROBE_EVERY_S, and one that has not heard a word within PROBE_LIMIT_S breaks and starts
again, so its waiters are named within seconds (routing/admission/naming.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from routing.admission.preemption import Preemptions
from routing.admission.waiting import Waiting
from routing.store.scripts import STORE_ERRORS
from routing.store.wire import text

# How often the subscription asks Redis for a word (PING), and how long it waits for one
# before it counts as broken: a grant whose wake-up was lost meanwhile is claimed by the
# sweeps that name the waiters once it starts again (within about 4 s), at defaults within
# the claim time (7 s: routing/admission/timing.py); past it, the grant goes back and its
# waiter is queued again at its place.
PROBE_EVERY_S = 1.0
PROBE_LIMIT_S = 2.0


class SubscriptionSilent(ConnectionError):
    """The subscription's connection did not answer a ping in time."""


class Probe:
    """When the subscription pings, and whether it heard back in time."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._sent: float | None = None  # an unanswered ping's time
        self._last = clock()  # the last ping's time

    def heard(self) -> None:
        """A word came (the answer to a ping, or any message): the connection delivers."""
        self._sent = None

    def late(self) -> bool:
        """Whether a ping went unanswered for PROBE_LIMIT_S."""
        return self._sent is not None and self.clock() - self._sent > PROBE_LIMIT_S

    def due(self) -> bool:
        """Whether to ping now (none unanswered, the last one PROBE_EVERY_S ago)."""
        now = self.clock()
        if self._sent is not None or now - self._last < PROBE_EVERY_S:
            return False
        self._sent = self._last = now
        return True


class Wakeups:
    def __init__(self, waiting: Waiting, preemptions: Preemptions) -> None:
        self.waiting, self.preemptions = waiting, preemptions
        # Per channel (a model or partition): (this replica's clock when a sweep left, Redis's
        # clock in ms when it ran there): Redis's moment ms happened at or after
        # sent + (ms - clock_ms) / 1000 here.
        self._clocks: dict[str, tuple[float, int]] = {}
        # How many times the subscription started: a keeper that saw fewer names its waiters.
        self.gaps = 0
        # Subscribed now: while not (its start, a break's backoff: seconds), every wake-up
        # is lost and the keeper's sweeps name the waiters every round.
        self.listening = False

    def saw_clock(self, channel: str, sent: float, clock_ms: int) -> None:
        """A sweep that left at `sent` (the waiting clock) ran in Redis at `clock_ms`."""
        if clock_ms:
            self._clocks[channel] = (sent, clock_ms)

    def moved(self) -> None:
        """The store moved to another master, whose clock is another: no grant's age is
        told until a sweep there answers, and no grant is older than a sweep there by
        that clock (a grant there may say a time before a sweep of the old master's)."""
        self._clocks.clear()
        for waiter in self.waiting.holdings.waiters.values():
            waiter.queued_ms = 0

    async def listen(self, client: aioredis.Redis, channels: list[str]) -> None:
        """One subscription until it breaks (the caller subscribes again)."""
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(*channels)
            self.gaps += 1  # wake-ups from before it may be lost: the sweeps look
            self.listening = True
            probe = Probe(asyncio.get_running_loop().time)
            while True:
                message = await pubsub.get_message(timeout=PROBE_EVERY_S)
                if message is None and probe.late():
                    # Once more: a loop that stalled may have timed the read out with the
                    # answer already there.
                    message = await pubsub.get_message(timeout=0.05)
                    if message is None:
                        raise SubscriptionSilent(f"no word within {PROBE_LIMIT_S:g} s of a ping")
                if message is not None:
                    probe.heard()
                    if message.get("type") != "pong":
                        self.on_message(message)
                if probe.due():
                    await pubsub.ping()
        finally:
            self.listening = False
            # Bounded: redis-py's close of a pub/sub interrupted mid-read can hang.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_close_quietly(pubsub), 1.0)

    def on_message(self, message: dict[str, Any]) -> None:
        data = text(message.get("data"))
        if data.startswith("!"):  # a lease preempted (routing/admission/preemption.py)
            self.preemptions.told(data[1:].partition(" ")[0])
            return
        granted_ms = 0
        if data.startswith("@"):
            when, _, data = data.partition(" ")
            granted_ms = int(when[1:]) if when[1:].isdigit() else 0
        waiter_id, _, endpoint = data.partition(" ")
        if endpoint:
            self.wake(waiter_id, endpoint, text(message.get("channel")), granted_ms)

    def wake(self, waiter_id: str, endpoint: str, channel: str = "", granted_ms: int = 0) -> None:
        """Resolve the waiter with its endpoint; a grant's time (Redis's clock, on
        `channel`) tells its waiter how old the grant may be at most."""
        waiter = self.waiting.holdings.waiters.get(waiter_id)
        if waiter is None or waiter.future.done():
            return
        if granted_ms and granted_ms < waiter.queued_ms:
            # Made before a sweep found its waiter queued (or queued it again): that grant
            # went back since (its replica was stopped past the claim time), its slot maybe
            # taken. Not a wake-up: the waiter waits on for its next grant.
            return
        clock = self._clocks.get(channel) if granted_ms else None
        if clock is not None:
            sent, clock_ms = clock
            self.waiting.kept(waiter_id, sent + (granted_ms - clock_ms) / 1000)
        waiter.future.set_result(endpoint)


async def _close_quietly(pubsub: Any) -> None:
    with contextlib.suppress(*STORE_ERRORS):
        await pubsub.aclose()
