"""Waiting in a model's queue for a grant (docs/api.md, queueing).

A request that may wait registers a `Waiter` before its acquire leaves (a wake-up may arrive
before the reply does); the keeper's wake-ups and sweeps resolve it with an endpoint, and a
replica that shuts down turns its waiters away. Whatever a waiter was granted or queued for
and does not keep goes back through routing/admission/handback.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from routing.admission.handback import Handback
from routing.admission.holdings import Waiter
from routing.errors import Unavailable, UnavailableReason
from routing.store.wire import text


class Waiting:
    def __init__(self, handback: Handback, clock: Callable[[], float] = time.monotonic) -> None:
        # The same store, slots and holdings as the give-backs.
        self.scripts, self.store = handback.scripts, handback.store
        self.slots, self.holdings = handback.slots, handback.holdings
        self.handback = handback
        self.clock = clock  # `Waiter.kept`'s

    def register(self, lease_id: str, model: str) -> None:
        """Before the acquire that may queue `lease_id` leaves."""
        future = asyncio.get_running_loop().create_future()
        self.holdings.waiters[lease_id] = Waiter(model, future, kept=self.clock())

    def kept(self, lease_id: str, when: float) -> None:
        """A call that left at `when` (`clock`) found `lease_id` still queued, or kept the
        grant it found for the lease's whole TTL (a sweep)."""
        waiter = self.holdings.waiters.get(lease_id)
        if waiter is not None:
            waiter.kept = max(waiter.kept, when)

    def queued_at(self, lease_id: str, redis_ms: int) -> None:
        """A sweep that ran at `redis_ms` (Redis's clock) found `lease_id` queued, or
        queued it again."""
        waiter = self.holdings.waiters.get(lease_id)
        if waiter is not None:
            waiter.queued_ms = max(waiter.queued_ms, redis_ms)

    def not_queued(self, lease_id: str) -> None:
        """The acquire did not queue it: its waiter goes, whatever became of it meanwhile."""
        waiter = self.holdings.waiters.pop(lease_id, None)
        if waiter is not None and waiter.future.done():
            waiter.future.exception()  # turned away meanwhile: not queued, nothing to say

    async def wait(self, lease_id: str, place: int, timeout_s: float) -> str | int:
        """The endpoint granted to the queued `lease_id` (at `place`, rank x RANK +
        sequence) within `timeout_s`; else (timed out) the grants likely to go before it if
        it queued again, for its Retry-After. Raises the reason it was turned away."""
        waiter = self.holdings.waiters[lease_id]
        model = waiter.model
        waiter.place = place  # from now on the sweep keeps it queued
        try:
            await asyncio.wait({waiter.future}, timeout=timeout_s)
        except asyncio.CancelledError:
            # Out of the queue, or its grant back (where, when its wake-up came already).
            self.handback.give_back(lease_id, model, None, _granted(waiter.future))
            raise
        finally:
            self.holdings.waiters.pop(lease_id, None)
        if waiter.future.done():
            if (turned_away := waiter.future.exception()) is not None:
                self.handback.give_back(lease_id, model, None)  # out of the queue, or its grant
                raise turned_away
            if self.clock() - waiter.kept <= self.slots[model].timing.trust_ms / 1000:
                return waiter.future.result()  # kept by the next sweep, as every lease held
            # Read too late to be sure its grant is still there (the replica was stopped,
            # its loop stalled): its claim time may have passed, the slot gone back and
            # been taken. Redis says (and keeps it for the lease's TTL if it is there); a
            # grant lost so is answered as a wait that timed out.
        return await self._cancel(lease_id, model)

    async def _cancel(self, lease_id: str, model: str) -> str | int:
        """Timed out; the slot may have been granted just now (its message still on the way)."""
        sent = self.scripts.send(self.store, [self.slots[model].cancel(lease_id)])
        reply = (await self.handback.outliving(sent, lease_id, model, None))[0]
        if isinstance(reply, Exception):
            self.handback.give_back(lease_id, model, None)
            raise reply
        if isinstance(reply, int):
            return reply
        return text(reply) or 0

    def turn_away(self, why: str) -> None:
        """This replica shuts down: its waiters leave their queues with a 503 now, rather
        than being cut when the grace period ends."""
        for waiter in self.holdings.waiters.values():
            if not waiter.future.done():
                waiter.future.set_exception(Unavailable(why, UnavailableReason.SHUTTING_DOWN))


def _granted(future: asyncio.Future[str]) -> str:
    """The endpoint a waiter's wake-up granted, or '' (none came, or it was turned away)."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return ""
    return future.result()
