"""Each replica's background work for admission (each loop through routing/background.py,
so no error ever ends one for good).

- One pub/sub subscription wakes this replica's waiters by id (no polling loops:
  routing/admission/wakeups.py).
- A sweep about every second, one round trip for all models: reclaims expired leases and
  dead replicas' waiters and hands their slots on; keeps alive, or writes back when Redis
  lost them, everything this replica holds (leases, account entries); says this replica is
  alive in each model (so its waiters stay queued); forgets ids whose state is in doubt;
  and reads each model's in-flight and queue depth for metrics and the rate of freed slots
  for Retry-After. It names this replica's waiters (each queued again at its original
  place if Redis lost it, its grant claimed if its wake-up was lost) once after each
  queued, and all only when they may have been lost (routing/admission/naming.py): a
  waiter costs nothing between.
- A spool round (about a second, its own loop) sends spooled usage records, adopts those
  of gone processes, and trims the stream (routing/ledger/records.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from routing.admission.accountkeeps import AccountKeeper, Batch
from routing.admission.admit import Admission
from routing.admission.naming import Naming
from routing.admission.replies import ModelState, Sweep, sweep_result
from routing.admission.reserved import RESERVED_EVERY, ReservedTokens
from routing.admission.wakeups import Wakeups
from routing.background import BackgroundErrors, every
from routing.ledger.spool import UsageSpool
from routing.store.keys import REPLICAS_KEY
from routing.store.scripts import Call, first_error
from routing.store.wire import text

log = logging.getLogger("gateway.admission")

# A subscription that keeps failing (a wrong password, a Sentinel port) is tried again
# after 0.5 s, then less and less often, up to this: never a spin. Wake-ups lost meanwhile
# are claimed by the sweeps.
SUBSCRIPTION_BACKOFF_S = 10.0
# A spool round longer than this (a stalled Redis) is cut; what it did not send stays spooled.
SPOOL_ROUND_S = 30.0


@dataclass
class _Round:
    """The calls of one sweep, and where each part's replies are."""

    calls: list[Call]
    models: list[str]
    waiters: dict[str, list[str]]
    orphans: list[str]
    orphan_calls: int
    # The models whose endpoint index changed: their index calls lead the round.
    indexed: list[str]
    # The models (or partitions) whose reserved tokens this round reads, at its end.
    reserved: list[str] = field(default_factory=list)
    # The leases whose start this round tells Redis again (after the accounts' calls).
    started: list[str] = field(default_factory=list)
    # When the round left (the admission's waiting clock): its waiters found queued, or
    # granted and kept for the lease's TTL, last that long from then at least.
    sent: float = 0.0
    # The accounts' keeps (the heartbeat follows their calls), and the heartbeat's mark.
    accounts: Batch | None = None
    mark: str = ""
    # The partitions whose sweep found Redis did not know this replica alive there.
    unknown: list[str] = field(default_factory=list)
    # Those of them whose sweep found Redis had lost writes since its last one.
    lost: list[str] = field(default_factory=list)
    # The round named every waiter (else only those new since the last round, if any), and
    # took out of Redis what this replica does not hold (`purge`: the store moved).
    every: bool = False
    purge: bool = False


@dataclass
class Keeper:
    admission: Admission
    # A connection for the subscription that no socket timeout cuts (redis-py #2807).
    pubsub_redis: aioredis.Redis
    interval_s: float = 1.0
    errors: BackgroundErrors = field(default_factory=BackgroundErrors)
    # A sweep round longer than this is cut (and counted): it never waits on a stall.
    round_timeout_s: float | None = 5.0
    states: dict[str, ModelState] = field(default_factory=dict)
    # Tokens reserved per (model, endpoint) with a budget, as a recent sweep read them.
    tokens: ReservedTokens = field(init=False)
    _rounds: int = 0
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # The store's moves to another master already answered (routing/ledger/recent.py).
    _moves: int = 0
    # Which accounts' entries each round keeps (not all at every round), and how.
    _accounts: AccountKeeper | None = None
    # Wake-ups by message, and which waiters each round names.
    wakeups: Wakeups = field(init=False)
    naming: Naming = field(init=False)

    def __post_init__(self) -> None:
        self.wakeups = Wakeups(self.admission.waiting, self.admission.preemptions)
        self.naming = Naming(self.wakeups, self.admission.timing.waiter_ttl_ms)
        self.tokens = ReservedTokens(self.admission)

    @property
    def reserved(self) -> dict[tuple[str, str], int]:
        return self.tokens.reserved

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._subscription()),
            loop.create_task(
                every("sweep", self.interval_s, self.sweep_once, self.errors,
                      timeout_s=self.round_timeout_s)
            ),
            loop.create_task(every("spool", self.interval_s, self._tend_spool, self.errors,
                                   timeout_s=SPOOL_ROUND_S)),
        ]  # fmt: skip

    def resubscribe(self) -> None:
        """The set of models changed: listen on every model's channel from now on."""
        if self._tasks:
            self._tasks[0].cancel()
            self._tasks[0] = asyncio.get_running_loop().create_task(self._subscription())

    def _subscription(self) -> Coroutine[Any, Any, None]:
        return every("subscription", 0.5, self._listen, self.errors,
                     max_backoff_s=SUBSCRIPTION_BACKOFF_S)  # fmt: skip

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- the sweep -----------------------------------------------------------------------

    async def sweep_once(self) -> None:
        work = self._round()
        due = self.naming.guard()
        try:
            replies = await self.admission.scripts.send(self.admission.store, work.calls)
        except BaseException:
            for model in work.indexed:  # its index writes may not have landed
                self.admission.slots[model].rewrite()
            if self._accounts is not None:
                # Its heartbeat may have run and found this replica gone (Redis restarted
                # empty), unseen: the next heartbeat finds it there. Every account next.
                self._accounts.keeps.lost()
            raise
        self._apply(work, replies)
        error = first_error(replies)
        if work.unknown:
            # Before any error of the round is raised: the sweeps that said so wrote this
            # replica alive, so no later round would be told again to name these waiters.
            await self._name_now(work.unknown, work.lost)
        if error is not None:
            raise error
        if self._accounts is not None and self._accounts.keeps.wants_all():
            # Redis lost this replica (its heartbeat just found it gone), a keep found
            # entries gone, or the store moved: every account now, not at the next round
            # (grants pause meanwhile: the rebuild window).
            batch = self._accounts.batch(self._rounds)
            beat, mark = self._accounts.heartbeat(REPLICAS_KEY)
            calls = [*batch.calls, beat]
            replies = await self.admission.scripts.send(self.admission.store, calls)
            self._accounts.answered(batch, replies[:-1])
            self._accounts.answered_beat(mark, replies[-1])
            if (error := first_error(replies)) is not None:
                raise error
        self.naming.ended(due)

    def _round(self) -> _Round:
        adm = self.admission
        sent = adm.waiting.clock()
        holdings = adm.holdings
        models = list(adm.slots)
        indexes = {m: call for m in models if (call := adm.slots[m].index()) is not None}
        moves = adm.store.moves or 0
        every, waiters = self.naming.choose(self._rounds, holdings.waiters_by_model(), moves)
        purge = every and self.naming.purge
        calls = [*indexes.values(), *self._sweeps(models, waiters, purge)]
        holdings.prune(2 * adm.timing.lease_ttl_ms / 1000)
        if self._accounts is None:
            self._accounts = AccountKeeper(adm, self.interval_s)
        accounts = self._accounts.batch(self._rounds)
        # The heartbeat after the accounts' keeps: its mark vouches for them.
        beat, mark = self._accounts.heartbeat(REPLICAS_KEY)
        calls += [*accounts.calls, beat]
        started, starts = adm.preemptions.unheard()
        calls += starts
        orphan_models, orphan_accounts = holdings.orphans_by_model()
        orphan_calls = [adm.slots[m].release(ids) for m, ids in orphan_models.items()]
        orphan_calls += [("ZREM", [key], ids) for key, ids in orphan_accounts.items()]
        self._rounds += 1
        reserved = self.tokens.reads(models) if self._rounds % RESERVED_EVERY == 1 else []
        reads: list[Call] = [("HGETALL", [adm.slots[m].reserved_key], []) for m in reserved]
        return _Round(
            calls + orphan_calls + reads,
            models,
            {m: [waiter_id for waiter_id, _ in ws] for m, ws in waiters.items()},
            list(holdings.orphans),
            len(orphan_calls) + len(reads),
            list(indexes),
            reserved,
            started,
            sent,
            accounts,
            mark,
            every=every,
            purge=purge,
        )

    def _sweeps(
        self, models: Sequence[str], waiters: dict[str, list[tuple[str, int]]], purge: bool
    ) -> list[Call]:
        """Each model's sweep: what this replica holds there, and the ids that may hold a
        lease not held here yet (counted as its own if they do: the local outage shares).
        `purge` (every waiter named): what else of its ids Redis holds goes."""
        holdings, slots = self.admission.holdings, self.admission.slots
        leases, pending = holdings.leases_by_model(), holdings.pending_by_model()
        replica, alive = self.admission.replica_id, self.naming.alive
        named = (w for ws in waiters.values() for w, _ in ws)
        ours = holdings.purging(named) if purge else None
        return [
            slots[m].sweep(
                leases.get(m, []), waiters.get(m, []), pending.get(m, []), replica, alive(m), ours
            )
            for m in models
        ]

    async def _name_now(self, parts: Sequence[str], lost: Sequence[str] = ()) -> None:
        """Redis did not know this replica alive in these partitions (it lost them, or
        their waiters left while the replica was away, or a failover lost writes): its
        waiters there named now, not at a later round (grants pause meanwhile where Redis
        lost the model: the rebuild window), and what it no longer holds taken out."""
        waiters = self.admission.holdings.waiters_by_model()
        if not (named := [p for p in parts if waiters.get(p) or p in lost]):
            return
        sent = self.admission.waiting.clock()
        calls = self._sweeps(named, waiters, purge=True)
        replies = await self.admission.scripts.send(self.admission.store, calls)
        for part, reply in zip(named, replies, strict=True):
            if not isinstance(reply, Exception):
                ids = [waiter_id for waiter_id, _ in waiters.get(part, [])]
                self._swept(part, sent, ids, sweep_result(reply))
        if (error := first_error(replies)) is not None:
            raise error

    def _apply(self, work: _Round, replies: Sequence[Any]) -> None:
        adm = self.admission
        now = asyncio.get_running_loop().time()
        for model, reply in zip(work.indexed, replies, strict=False):
            adm.slots[model].indexed(reply)
        replies = replies[len(work.indexed) :]
        found_parts: dict[str, Sweep] = {}
        for part, reply in zip(work.models, replies, strict=False):
            if isinstance(reply, Exception):
                continue
            found_parts[part] = found = sweep_result(reply)
            self._swept(part, work.sent, work.waiters.get(part, []), found)
            if found.lost and not work.purge:
                work.lost.append(part)  # (none of what it lost taken out yet)
            if (found.name and not work.every) or (found.lost and not work.purge):
                work.unknown.append(part)  # (those new alone were named)
        self._saw_models(found_parts, now)
        at = len(work.models)
        calls = len(work.accounts.calls) if work.accounts is not None else 0
        if work.accounts is not None and self._accounts is not None:
            self._accounts.answered(work.accounts, replies[at : at + calls])
        at += calls
        self._beat(work.mark, replies[at])
        at += 1
        adm.preemptions.heard(work.started, replies[at : at + len(work.started)])
        tail = replies[len(replies) - work.orphan_calls :] if work.orphan_calls else []
        reads = tail[len(tail) - len(work.reserved) :] if work.reserved else []
        tail = tail[: len(tail) - len(work.reserved)]
        if first_error(tail) is None:
            adm.holdings.forgotten(work.orphans)
        for part, reply in zip(work.reserved, reads, strict=True):
            if not isinstance(reply, Exception):
                self.tokens.saw(part, reply)

    def _swept(self, part: str, sent: float, named: Sequence[str], found: Sweep) -> None:
        """What a partition's sweep (left at `sent`, naming these waiters) found: the
        model's state, leases written back, and the waiters it named."""
        slots = self.admission.slots[part]
        slots.known = True
        slots.saw(found.state.version)
        slots.seen_queue = found.state.queued
        self.wakeups.saw_clock(slots.channel, sent, found.clock_ms)
        self.naming.swept(part, found.clock_ms)
        self.admission.handback.recheck(found.restored, part)
        self._waiters(part, sent, named, found)
        if found.purged:
            log.warning("redis lost writes: %d leases and waiters no request holds taken out"
                        " of %s", found.purged, part)  # fmt: skip

    def _beat(self, mark: str, reply: Any) -> None:
        """The heartbeat's answer: whether Redis lost writes (the accounts' keeps), and the
        live replicas."""
        if self._accounts is not None:
            self._accounts.answered_beat(mark, reply)
        if not isinstance(reply, Exception):
            self.admission.local.saw([text(r) for r in reply[1]])

    def _saw_models(self, found: dict[str, Sweep], now: float) -> None:
        """Each model's state, its partitions' summed, when the sweep read them all; the
        local shares see its in-flight count and this replica's leases among it (each
        partition's both read in one instant, by its sweep's script)."""
        adm = self.admission
        parts: dict[str, list[str]] = {}  # each model's partitions, those a reload left too
        for part, model in adm.model_of.items():
            parts.setdefault(model, []).append(part)
        for model, mine in parts.items():
            if all(p in found for p in mine):
                state = _summed([found[p].state for p in mine])
                adm.local.observe(model, state.inflight, sum(found[p].mine for p in mine))
                self.states[model] = state
                adm.retry.freed(model, now, state.freed)

    def _waiters(self, part: str, sent: float, named: Sequence[str], found: Sweep) -> None:
        """The waiters the sweep named: kept from when it left (found queued, or granted
        and kept for the lease's TTL; not those it queued again as lost: a wake-up read
        later may tell of a grant that is gone), then woken or given back (`_found`)."""
        again = set(found.requeued)
        for waiter_id, endpoint in zip(named, found.granted, strict=True):
            if waiter_id not in again:
                self.admission.waiting.kept(waiter_id, sent)
            if not endpoint:
                self.admission.waiting.queued_at(waiter_id, found.clock_ms)
            self._found(part, waiter_id, endpoint)

    def _found(self, part: str, waiter_id: str, endpoint: str) -> None:
        """A waiter the sweep named: woken if granted. One this replica no longer holds
        (its caller left while the sweep was on its way, and its give-back may have landed
        first: the sweep then queued it again, or kept its grant) is given back again."""
        holdings = self.admission.holdings
        if waiter_id in holdings.waiters or holdings.is_live(waiter_id):
            if endpoint:
                self.wake(waiter_id, endpoint)
            return
        self.admission.handback.give_back(waiter_id, part, None, endpoint)

    def wake(self, waiter_id: str, endpoint: str) -> None:
        self.wakeups.wake(waiter_id, endpoint)

    async def _tend_spool(self) -> None:
        adm = self.admission
        spool, send = adm.ledger.spool, adm.ledger.send
        if spool is None:
            return
        self._resend_after_a_move(spool)

        async def reporting(calls: Sequence[Call]) -> list[Any]:
            replies = await send(calls)
            if (refused := first_error(replies)) is not None:  # a record Redis would not take
                self.errors.store.report(refused, "spool")
            return replies

        await spool.tend(reporting)

    def _resend_after_a_move(self, spool: UsageSpool) -> None:
        """The store moved to another master: what the old one took lately may be gone
        with it (routing/ledger/recent.py), so it is spooled again for this round to send."""
        moves, recent = self.admission.store.moves, self.admission.handback.recent
        if moves is None or moves <= self._moves or recent is None:
            return
        again = recent.lately()
        for record in again:
            spool.add(record)
        self._moves = moves
        log.warning("redis moved to another master: %d recent usage records resent", len(again))

    # --- wake-ups ------------------------------------------------------------------------

    async def _listen(self) -> None:
        """One subscription until it breaks (then `every` counts the error and resubscribes)."""
        channels = [s.channel for s in self.admission.slots.values()]
        await self.wakeups.listen(self.pubsub_redis, channels)


def _summed(states: Sequence[ModelState]) -> ModelState:
    """A model's state over its partitions."""
    queued = {t: sum(s.queued.get(t, 0) for s in states) for t in states[0].queued}
    freed = sum(s.freed for s in states)
    return ModelState(sum(s.inflight for s in states), queued, freed, states[0].version)
