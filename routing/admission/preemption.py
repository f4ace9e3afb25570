"""Preemption of flex before its first byte (docs/api.md, preemption), this replica's side.

The choice is made in Redis (routing/store/lua/prelude_*.lua `preempt`): a newcomer of a tier
that may preempt, about to queue, takes the lease of a flex request that has not started,
and its holder is told on the model's wake channel ("!id endpoint"). Here: the requests of
this replica that may still be preempted, each with a future its route waits on beside its
worker's answer (`watch`); the message resolves it (`told`); and the check a request makes
before its first byte goes to its caller (`Admission.start`), which answers "preempted" if
the lease was taken first, so that a request that has started streaming is never cut. A
check Redis did not answer is sent again with the keeper's sweeps until it is (`unheard`),
so that Redis stops offering a request that runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from routing.admission.handback import Handback
from routing.admission.holdings import Lease
from routing.store.scripts import STORE_ERRORS, Call


class Preemptions:
    def __init__(self, handback: Handback) -> None:
        # The same store and slots as the give-backs.
        self.scripts, self.store, self.slots = handback.scripts, handback.store, handback.slots
        self._watched: dict[str, asyncio.Future[None]] = {}
        # Leases whose check before their first byte Redis did not answer (perhaps chosen
        # unseen: `done`); of those, the ones Redis has not been told since (`unheard`).
        self._unsure: set[str] = set()
        self._unheard: dict[str, Lease] = {}

    def watch(self, lease_id: str) -> asyncio.Future[None]:
        """A future resolved when `lease_id`'s holder is told it was preempted."""
        future = self._watched.get(lease_id)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._watched[lease_id] = future
        return future

    def told(self, lease_id: str) -> None:
        """The message: `lease_id` was preempted (one of another replica's is ignored)."""
        future = self._watched.get(lease_id)
        if future is not None and not future.done():
            future.set_result(None)

    def forget(self, lease_id: str) -> None:
        future = self._watched.pop(lease_id, None)
        if future is not None and not future.done():
            future.cancel()

    async def started(self, lease: Lease) -> bool:
        """A preemptible request is about to send its first byte: False when its lease was
        preempted first (it sends nothing then). Redis not answering: True (nobody can have
        chosen it where nothing answers). From then on it is never cut: a message for it
        (a choice made where its start was not seen, e.g. by a Redis that came back with
        its state) is ignored, and its release clears the mark such a choice left."""
        if lease.local:
            return True
        call = self.slots[lease.keys].start(lease.id, lease.endpoint)
        try:
            reply = await asyncio.shield(self.scripts.call(self.store, call))
        except STORE_ERRORS:
            self._unsure.add(lease.id)
            self._unheard[lease.id] = lease
        else:
            if int(reply) != 1:
                return False
        self._watched.pop(lease.id, None)  # unresolved: its route waits for its hop alone
        return True

    def unheard(self) -> tuple[list[str], list[Call]]:
        """The leases of requests that began without Redis's answer, and their `start`
        calls again (the keeper's sweep sends them): until Redis hears one, it still offers
        the lease (`pre`), and a newcomer that may preempt could choose it and wait for a
        request that never gives way, instead of taking one that has not started."""
        leases = self._unheard.values()
        return list(self._unheard), [self.slots[x.keys].start(x.id, x.endpoint) for x in leases]

    def heard(self, lease_ids: Sequence[str], replies: Sequence[Any]) -> None:
        """Redis's replies to `unheard` calls: a lease it answered for is no longer offered
        there. A 0 (it was chosen meanwhile) changes nothing here: the request has started
        and is never cut; its release clears the mark (`done`)."""
        for lease_id, reply in zip(lease_ids, replies, strict=True):
            if not isinstance(reply, BaseException):
                self._unheard.pop(lease_id, None)

    def done(self, lease: Lease, preempted: bool) -> list[Call]:
        """`lease` ends: no longer watched. The calls for its release's batch: one that
        ended before its first byte is no longer offered (`pre`: else it stayed there two
        lease TTLs, or for good once no tier may preempt); one preempted, or perhaps
        chosen unseen, leaves the list of those on their way out (`doomed`)."""
        unstarted = lease.id in self._watched  # watched until it starts
        self.forget(lease.id)
        unsure = lease.id in self._unsure
        self._unsure.discard(lease.id)
        unheard = self._unheard.pop(lease.id, None) is not None
        if lease.local:
            return []
        slots = self.slots[lease.keys]
        calls: list[Call] = []
        if unstarted or unheard:
            calls.append(("ZREM", [slots.pre_key], [f"{lease.id} {lease.endpoint}"]))
        if preempted or unsure or unstarted:
            calls.append(("ZREM", [slots.doomed_key], [lease.id]))
        return calls
