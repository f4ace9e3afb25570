"""Giving back what a replica took in Redis, whatever happens: the release at the end of a
request, the give-back of what a call took when its caller left or another call failed,
and the ids whose state in Redis is in doubt. (A woken waiter's grant needs no call of its
own: the replica's next sweep keeps it, as it keeps every lease it holds.)

Every call here leaves at once and is never cancelled with its caller: the caller may await
the result or not. A call that fails hands its ids to `Holdings.doubt`, for the sweeps to
forget; a usage record that does not reach Redis waits in the spool.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from routing.admission.estimate import RetryAfter
from routing.admission.holdings import Holdings, Lease
from routing.admission.slots import ModelSlots
from routing.ledger.recent import Recent
from routing.ledger.records import DEFAULT_RETENTION_S, FirstSends
from routing.ledger.spool import UsageSpool
from routing.store.base import Store
from routing.store.causes import StoreErrors
from routing.store.futures import shielded
from routing.store.resp import NotSent
from routing.store.scripts import STORE_ERRORS, Call, Scripts, first_error
from routing.store.wire import text
from tiers.usage import encodable


class Handback:
    def __init__(
        self,
        scripts: Scripts,
        store: Store,
        slots: Mapping[str, ModelSlots],
        holdings: Holdings,
        spool: UsageSpool | None,
        retry: RetryAfter,
        store_errors: StoreErrors | None = None,
    ) -> None:
        self.scripts = scripts
        self.store = store
        self.slots = slots
        self.holdings = holdings
        self.spool = spool
        # Records a master took, to send again if the store moves to another (Sentinel).
        self.recent = Recent() if store.moves is not None else None
        if spool is not None:
            spool.recent = self.recent  # so do those its rounds send
        self._first_sends = FirstSends()
        self._retry = retry
        # Calls on their way that close() waits for (releases, give-backs, late replies).
        self._pending: set[asyncio.Future[Any]] = set()
        # Releases not answered yet, with their usage records (spooled if never answered).
        self._releasing: dict[asyncio.Future[None], Mapping[str, str] | None] = {}
        self.store_errors = store_errors if store_errors is not None else StoreErrors()

    # --- leases --------------------------------------------------------------------------

    def release(
        self, lease: Lease, usage: Mapping[str, str] | None = None, also: Sequence[Call] = ()
    ) -> asyncio.Future[None]:
        """Give the slot back, with the request's usage record in the same round trip. The
        calls leave at once, whatever happens to the caller afterwards; awaiting the
        result (never an error) is optional. A record Redis did not take is spooled; a
        release Redis did not answer is retried by the sweeps. `also`: more calls in the
        same batch whose failures are only reported (a rate limit's true-up, a preempted
        lease's mark)."""
        self.holdings.released(lease)
        self._retry.held(lease.model, time.monotonic() - lease.since)
        if usage is not None:
            # Every value encodable whatever the caller sent, so the record can never stop
            # the release (a copy of the caller's), and the admission attempt: unique per
            # admission, unlike request ids.
            usage = encodable(usage)
            usage["attempt"] = lease.id
        released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not lease.endpoint:  # a local lease never placed: Redis never held it
            self._spool(usage)
            released.set_result(None)
            return released
        calls = self._release_calls(lease)
        held = len(calls)
        calls += also
        if usage is not None:
            retention = self.spool.retention_s if self.spool is not None else DEFAULT_RETENTION_S
            calls.append(self._first_sends.call(usage, retention))
        sent = self.scripts.send(self.store, calls)
        self._releasing[released] = usage
        released.add_done_callback(self._releasing.pop)
        moves = self.store.moves
        sent.add_done_callback(partial(self._released, lease, usage, released, (held, moves)))
        return released

    def _released(
        self,
        lease: Lease,
        usage: Mapping[str, str] | None,
        released: asyncio.Future[None],
        sent_when: tuple[int, int | None],
        sent: asyncio.Future[list[Any]],
    ) -> None:
        """`sent_when`: the replies of the slot's release, first in the batch, and the
        store's moves to another master when the calls left."""
        count, moves = sent_when
        failed = None if sent.cancelled() else sent.exception()
        replies = None if sent.cancelled() or failed else sent.result()
        held = None if replies is None else replies[:count]
        if replies is not None:  # the extra calls (`also`): failures only reported
            for reply in replies[count : len(replies) - (usage is not None)]:
                self._reported(reply, "release")
        if held is None or (failed := first_error(held)) is not None:
            self.holdings.doubt(lease.id, lease.keys, lease.account)  # the sweeps retry it
            if failed is not None:
                self.store_errors.report(failed, "release")
        if usage is not None and (replies is None or isinstance(replies[-1], Exception)):
            self._spool(usage)  # e.g. Redis at maxmemory refuses records: they wait on disk
            self._first_sends.forget()
            if replies is not None:
                self.store_errors.report(replies[-1], "usage record")
        elif usage is not None and self.recent is not None:
            self.recent.took(usage)
            if self.store.moves != moves:  # taken by a master left meanwhile: perhaps lost,
                self._spool(usage)  # and perhaps after the recent ones were sent again
        if not released.done():
            released.set_result(None)

    def _release_calls(self, lease: Lease) -> list[Any]:
        """The slot and the account's entry: one call on one Redis, else one per node."""
        slots = self.slots[lease.keys]
        if self.store.one_node:
            return [slots.release([lease.id], lease.account, lease.endpoint)]
        return [
            slots.release([lease.id], endpoint=lease.endpoint),
            ("ZREM", [lease.account], [lease.id]),
        ]

    def _spool(self, usage: Mapping[str, str] | None) -> None:
        if usage is not None and self.spool is not None:
            self.spool.add(usage)

    def recheck(self, restored: Any, model: str | None, account: str | None = None) -> None:
        """Ids Redis had lost and a call wrote back (in `model`'s leases or an `account`'s
        count): any this replica no longer holds (released meanwhile) goes back again."""
        if isinstance(restored, list):
            for lease_id in map(text, restored):
                if not self.holdings.is_live(lease_id):
                    self.give_back(lease_id, model, account)

    def give_back(
        self, lease_id: str, model: str | None, account: str | None, endpoint: str = ""
    ) -> None:
        """Forget `lease_id` in Redis now: idempotent calls that leave at once. When they
        fail, the sweeps forget it instead. `endpoint`: where its slot is, when known (else
        Redis looks it up, over every endpoint for a lease a grant did not make)."""
        calls: list[Any] = []
        if model is not None:
            calls.append(self.slots[model].release([lease_id], endpoint=endpoint))
        if account is not None:
            calls.append(("ZREM", [account], [lease_id]))
        if not calls:
            return
        sent = self.scripts.send(self.store, calls)
        sent.add_done_callback(partial(self._given_back, lease_id, model, account))
        self._track(sent)

    def _given_back(
        self, lease_id: str, model: str | None, account: str | None, sent: asyncio.Future[Any]
    ) -> None:
        if sent.cancelled() or sent.exception() is not None or first_error(sent.result()):
            self.holdings.doubt(lease_id, model, account)

    async def outliving(
        self, work: asyncio.Future[list[Any]], lease_id: str, model: str, account: str | None
    ) -> list[Any]:
        """Await calls already on their way. If the caller is cancelled meanwhile, they still
        finish and whatever they took is given back; a call that fails leaves its effect
        in doubt, for the sweeps to forget."""
        try:
            return await shielded(work)
        except asyncio.CancelledError:
            work.add_done_callback(partial(self._late, lease_id, model, account))
            self._track(work)
            raise
        except STORE_ERRORS as exc:
            if not isinstance(exc, NotSent):
                self.holdings.doubt(lease_id, model, account)
            raise

    def _late(
        self, lease_id: str, model: str, account: str | None, work: asyncio.Future[Any]
    ) -> None:
        if work.cancelled():
            self.holdings.doubt(lease_id, model, account)
        elif (exc := work.exception()) is not None:
            if not isinstance(exc, NotSent):
                self.holdings.doubt(lease_id, model, account)
        else:
            # The last call's reply names the endpoint it granted, if it granted one.
            replies = work.result()
            last = replies[-1] if replies else None
            endpoint = text(last) if isinstance(last, bytes | str) else ""
            self.give_back(lease_id, model, account, endpoint)

    def _reported(self, reply: Any, what: str) -> None:
        if isinstance(reply, Exception):
            self.store_errors.report(reply, what)

    def track(self, future: asyncio.Future[Any]) -> None:
        """A call on its way that close() waits for (besides those made here)."""
        self._track(future)

    def _track(self, future: asyncio.Future[Any]) -> None:
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Give back every slot this replica still holds (best effort) and finish what is
        on its way; records of releases Redis never answered wait on disk."""
        for lease in list(self.holdings.held.values()):
            self.release(lease)
        await self.drain(timeout_s)
        for usage in list(self._releasing.values()):
            self._spool(usage)
        self._releasing.clear()

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for calls already on their way (and those they start)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while pending := [*self._pending, *self._releasing]:
            left = deadline - loop.time()
            if left <= 0:
                return
            await asyncio.wait(pending, timeout=left)
