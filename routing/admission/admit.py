"""Fleet-wide admission (docs/api.md): slots leased in Redis, a tiered queue, precise 429s.

`Admission.admit` walks the request's candidates (routing/admission/plan.py) and returns a `Lease`
on one model's endpoint, or raises `Limited` with the last entry's reason (routing/errors.py). Every
path out of a request calls `release`, whose calls leave at once whatever happens to the caller.

Nothing a replica takes in Redis is ever left to chance: what it holds is remembered in `holdings`
and written back by every sweep (Redis restarted empty); whatever a call took whose caller went away
is given back when its reply arrives; and an id whose state is in doubt (a call that failed without
an answer) is forgotten by the next sweeps. The Redis protocol lives in routing/admission/slots.py
and the Lua files; the sweep in routing/admission/keeper.py.

Admission walks; the parts live apart: one candidate's acquire in routing/admission/acquire.py, the
wait for a queued grant in routing/admission/waiting.py, the 429s in routing/admission/refusals.py
and their Retry-After in routing/admission/estimate.py, the answer while Redis is away in
routing/admission/outage.py, the release in routing/admission/handback.py and the usage spool's
owner in routing/ledger/spool.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from routing.admission import refusals
from routing.admission.acquire import Acquire, Walk
from routing.admission.estimate import RetryAfter, max_turn, wait_s
from routing.admission.handback import Handback
from routing.admission.holdings import Holdings, Lease, Waiter
from routing.admission.layout import Layout, indexed
from routing.admission.outage import LocalShares, Outage
from routing.admission.plan import Candidate
from routing.admission.preemption import Preemptions
from routing.admission.ratelimit import RateCharge, RateLimits, Rates, failed_quotas
from routing.admission.replies import Attempt
from routing.admission.slots import (
    GRANTED,
    PAST_DEADLINE,
    QUEUED,
    RANK,
    EndpointSpec,
    ModelSlots,
    make_lease_id,
)
from routing.admission.timing import Timing
from routing.admission.tokens import TokenAsk, reservation, too_large
from routing.admission.waiting import Waiting
from routing.errors import RoutingError, TooLarge, Unavailable, UnavailableReason
from routing.ledger.records import store_sender
from routing.ledger.spool import Ledger, UsageSpool
from routing.registry import Registry
from routing.store.base import Store
from routing.store.causes import StoreErrors
from routing.store.keys import account_key
from routing.store.scripts import STORE_ERRORS, Scripts
from routing.store.wire import text
from tiers.policy import Tier, TiersConfig

__all__ = ["STORE_ERRORS", "Admission", "Admitted", "Lease"]

log = logging.getLogger("gateway.admission")


# Not frozen, treated as immutable: a frozen dataclass's __init__ costs 3.5 times as much
# (0.52 against 0.15 us), and one is made per request (hot path); hashable all the same.
@dataclass(slots=True, unsafe_hash=True)
class Admitted:
    lease: Lease
    candidate: Candidate
    tier: Tier
    # What its rate limits charged (routing/admission/ratelimit.py): None without limits,
    # or when Redis did not answer (admitted by the outage's local share).
    rate: RateCharge | None = None
    # The wait estimated for it when it queued (None: it did not, or no rate was known).
    wait_estimate_s: float | None = None
    # Whether a tier that may preempt can take its slot until it starts (`start`).
    preemptible: bool = False


class Admission:
    def __init__(
        self,
        store: Store,
        registry: Registry,
        tiers: TiersConfig,
        *,
        lease_ttl_s: float,
        on_outage: str,
        spool: UsageSpool | None = None,
        replica_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sweep_interval_s: float = 1.0,
        command_timeout_s: float = 2.0,
        store_errors: StoreErrors | None = None,
        scripts: Scripts | None = None,
    ) -> None:
        # Where the scripts run (the lean pipelining client when the URL allows it); started:
        # scripts loaded, endpoint changes are written to Redis at once.
        self.store, self._started = store, False
        self.scripts = scripts if scripts is not None else Scripts()
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.timing = Timing.of(lease_ttl_s, sweep_interval_s, command_timeout_s)
        self._tiers, self._clock, self._ids = tiers, clock, itertools.count()
        self.holdings, self.retry = Holdings(), RetryAfter()
        self.outage = Outage(on_outage, LocalShares(self.replica_id, tiers))
        self.local = self.outage.local
        # The config's models as slots (routing/admission/layout.py): the same dicts always.
        self.layout = Layout(self.timing, declare_all=not store.one_node)
        self.slots, self.rotations, self.model_of = (
            self.layout.slots, self.layout.rotations, self.layout.model_of
        )  # fmt: skip
        self.apply(registry, tiers)
        self.store_errors = store_errors if store_errors is not None else StoreErrors()
        self.handback = Handback(
            self.scripts, self.store, self.slots, self.holdings, spool, self.retry,
            self.store_errors,
        )  # fmt: skip
        self.waiting, self.preemptions = Waiting(self.handback), Preemptions(self.handback)
        self.acquire = Acquire(self.handback, self.waiting, self.timing, clock)
        self.ledger = Ledger(spool, store_sender(self.scripts, self.store))

    @property
    def rates(self) -> Rates:
        return self.acquire.rates

    @property
    def held(self) -> dict[str, Lease]:
        return self.holdings.held

    @property
    def waiters(self) -> dict[str, Waiter]:
        return self.holdings.waiters

    async def start(self) -> None:
        self._started = True
        try:
            await self.scripts.load(self.store)
        except STORE_ERRORS as exc:  # not fatal: loaded again on first use (NOSCRIPT)
            self.store_errors.report(exc, "start")

    # --- the walk ------------------------------------------------------------------------

    async def admit(
        self,
        candidates: Sequence[Candidate],
        account: str,
        account_limit: int,
        cache_key: str | None = None,
        weight: float = 1.0,
        *,
        tokens: TokenAsk | None = None,
        rates: RateLimits | None = None,
        deadline_s: float | None = None,
        at_head: bool = False,
    ) -> Admitted:
        """`weight`: the account's share in a tier's fair share. `tokens`: the request's
        prompt estimate and answer, for token budgets (`reservation`) and a key's tokens
        limit. `rates`: the key's rate limits (routing/admission/ratelimit.py), charged a
        request and `tokens`. `deadline_s`: how long the caller waits (x-request-timeout): a
        wait estimated longer is refused at once, a queued request leaves when it passes.
        `at_head`: queue before the tier's waiters (a preempted request's second try)."""
        walk = self._walk_of(candidates, account, account_limit, cache_key, weight, tokens)
        if rates is not None:
            walk.rates, walk.rate_tokens = rates, Rates.charge_of(rates, tokens, candidates)
        if deadline_s is not None:
            walk.deadline, walk.deadline_s = self._clock() + deadline_s, deadline_s
        walk.at_head = at_head
        admitted = None
        try:
            admitted = await self._admit(walk, candidates)
            admitted.rate = walk.charge
            return admitted
        except RoutingError as exc:
            exc.model = exc.model or walk.at
            exc.quotas = exc.quotas or failed_quotas(rates, walk.charge, asked=walk.rated)
            raise
        finally:
            self._walked(walk, admitted is not None)

    def _walked(self, walk: Walk, admitted: bool) -> None:
        """The walk ended: what it took and does not keep goes back (the account's entry
        when not admitted, its rate charge then too)."""
        if self.holdings.end(walk.lease_id) is not None:  # not admitted
            self.handback.give_back(walk.lease_id, None, walk.akey)
        if not admitted and walk.charge is not None:  # nor charged, then
            self.rates.give_back(walk.charge)

    def _walk_of(
        self, candidates: Sequence[Candidate], account: str, limit: int, cache_key: str | None,
        weight: float, tokens: TokenAsk | None,
    ) -> Walk:  # fmt: skip
        """A new walk, its lease id carrying its account, weight and reservation."""
        reserved = self.reservation(candidates, tokens)
        number, akey = next(self._ids), account_key(account)
        lease_id = make_lease_id(f"{self.replica_id}-{number}", weight, account, reserved)
        self.holdings.begin(number, lease_id, akey)
        return Walk(lease_id, account, akey, limit, cache_key, reserved)

    async def _admit(self, walk: Walk, candidates: Sequence[Candidate]) -> Admitted:
        """The walk; Redis away, the outage's answer, unless the caller's deadline passed
        meanwhile (a stalled call fails after it): then that is the answer."""
        try:
            return await self._walk(walk, candidates, self._clock())
        except STORE_ERRORS as exc:
            self.store_errors.report(exc, "admission", refused=True)
            if walk.deadline is not None and self._clock() >= walk.deadline:
                retry = self.retry_after(walk.at, 0)
                raise refusals.deadline_passed(walk.at, walk.deadline_s, retry) from exc
            ours = (walk.lease_id, walk.akey, self.holdings, exc, walk.tokens)
            cand, lease = self.outage.admit(candidates, *ours)
            return Admitted(lease, cand, cand.tier)

    async def _walk(
        self,
        walk: Walk,
        candidates: Sequence[Candidate],
        started: float,
    ) -> Admitted:
        last: RoutingError | None = None
        for cand in candidates:
            walk.at = cand.model.name
            if self.capacity(cand.model.name) == 0:
                why = f"{cand.model.name!r} has no healthy endpoint."
                last = Unavailable(why, UnavailableReason.NO_HEALTHY_ENDPOINT)
                continue
            if (too_large := self._too_large(cand.model.name, walk.tokens, cand.tier)) is not None:
                last = too_large
                continue
            deadline = self._clock() + self._tiers.policy(cand.tier).queue_timeout_s
            if walk.deadline is not None:
                deadline = min(deadline, walk.deadline)
            admitted, last = await self._try_parts(walk, cand, deadline, started)
            if admitted is not None:
                return admitted
        assert last is not None
        raise last

    async def _try_parts(
        self, walk: Walk, cand: Candidate, deadline: float, started: float
    ) -> tuple[Admitted | None, RoutingError | None]:
        """The candidate's partitions in turn (routing/admission/partitions.py): the first
        with room admits; only the last tried may queue (if it left rotation meanwhile: all
        of them again, once, as they are now). Else the last one's refusal."""
        model, tier, again = cand.model.name, cand.tier, cand.may_wait
        order = self.rotations[model].order(walk.cache_key, cand.may_wait, tier, self.slots)
        last: RoutingError | None = None
        for part, may_wait in order:
            if self.slots[part].capacity == 0:  # out of rotation meanwhile
                if may_wait and again:  # never answered as a fail_fast request
                    order += self.rotations[model].order(walk.cache_key, True, tier, self.slots)
                    again = False
                continue
            rate = self.retry.rate(model, self.capacity(model))
            # The most grants it may wait behind in this partition and meet its deadline.
            left = None if walk.deadline is None else walk.deadline - self._clock()
            walk.max_turn = None if left is None else max_turn(left, rate, self.layout.live(model))
            result = await self.acquire.past_rebuild(walk, part, may_wait, tier, deadline)
            estimate = wait_s(self._model_turn(model, result.turn), rate)
            endpoint = await self._settle(walk, model, tier, result, deadline)
            if endpoint is not None:
                queued_ms = (self._clock() - started) * 1000
                lease = Lease(
                    walk.lease_id, model, endpoint, walk.akey, queued_ms, part=part,
                    tokens=walk.tokens,
                )  # fmt: skip
                self.holdings.walking.pop(walk.lease_id, None)  # the lease owns the entry now
                self.holdings.held[lease.id] = lease
                queued = estimate if result.status == QUEUED and not result.preempted else None
                preemptible = self.slots[part].preemptible(tier)
                return Admitted(lease, cand, tier, None, queued, preemptible), None
            retry = self.retry_after(model, self._model_turn(model, result.turn))
            last = refusals.rejection(model, tier, result, retry)
            last.wait_estimate_s = estimate if result.status == PAST_DEADLINE else None
        if last is None:  # every partition went out of rotation while this one walked
            why = f"{model!r} has no healthy endpoint."
            last = Unavailable(why, UnavailableReason.NO_HEALTHY_ENDPOINT)
        return None, last

    async def _settle(
        self, walk: Walk, model: str, tier: Tier, result: Attempt, deadline: float
    ) -> str | None:
        """The granted endpoint (at once, or after waiting in the queue until `deadline`,
        the end of its queue timeout: a wait for a rebuild window came out of it), or None."""
        if result.status != QUEUED:
            self.waiting.not_queued(walk.lease_id)
            return result.endpoint if result.status == GRANTED else None
        timeout = self._tiers.policy(tier).queue_timeout_s
        place = tier.rank * RANK + result.place
        outcome = await self.waiting.wait(walk.lease_id, place, max(0.0, deadline - self._clock()))
        if isinstance(outcome, str):
            return outcome
        # Timed out: its Retry-After from its turn if it came again.
        retry = self.retry_after(model, self._model_turn(model, outcome))
        if walk.deadline is not None and walk.deadline <= deadline:  # its own deadline passed
            raise refusals.deadline_passed(model, walk.deadline_s, retry)
        raise refusals.queue_timeout(model, timeout, retry)

    # --- leases --------------------------------------------------------------------------

    def release(
        self,
        lease: Lease,
        usage: Mapping[str, str] | None = None,
        rate: RateCharge | None = None,
        *,
        preempted: bool = False,
    ) -> asyncio.Future[None]:
        """Give the slot back, with the request's usage record (routing/admission/handback.py)
        and, in the same batch, its token charge trued up to the tokens the record says
        were used (`rate`: `Admitted.rate`); a preempted lease leaves `doomed` too."""
        settle = self.rates.settle(rate, usage) if rate is not None else None
        also = [settle] if settle is not None else []
        return self.handback.release(lease, usage, also + self.preemptions.done(lease, preempted))

    def place(self, lease: Lease, endpoint: str) -> None:
        """The outage's local `lease` runs on `endpoint` (written back when Redis is)."""
        lease.endpoint, lease.part = endpoint, self.layout.part_of.get((lease.model, endpoint), "")

    async def reroute(
        self, lease: Lease, avoid: str, only: Sequence[str] | None = None, *, tier: Tier
    ) -> bool:
        """Move a held slot of `tier` off an endpoint that could not be reached (or unknown
        here) onto another with room for it, keeping the slot from waiters; False: none."""
        call = self.slots[lease.keys].move(lease.id, avoid, only, tier=tier)
        try:
            endpoint = text(await asyncio.shield(self.scripts.call(self.store, call)))
        except STORE_ERRORS:
            return False
        if not endpoint:
            return False
        lease.endpoint = endpoint
        return True

    def retry_after(self, model: str, ahead: int) -> int:
        return self.retry.seconds(model, ahead, self.capacity(model))

    def reservation(self, candidates: Sequence[Candidate], tokens: TokenAsk | None) -> int:
        """What a request reserves of an endpoint's token budget (routing/admission/
        tokens.py `reservation`)."""
        budgeted = {
            c.model.name
            for c in candidates
            if any(self.slots[p].budgeted for p in self.rotations[c.model.name].parts)
        }
        return reservation(candidates, tokens, budgeted)

    def _too_large(self, model: str, tokens: int, tier: Tier) -> TooLarge | None:
        parts = [self.slots[p] for p in self.rotations[model].parts]
        whole = max((w for s in parts if (w := s.largest_budget())), default=None)
        return too_large(model, tokens, [s.largest_budget(tier) for s in parts], tier, whole)

    def _model_turn(self, model: str, turn: int) -> int:
        """A turn in one partition's queue as one in the model's: each partition gets about
        its share of the model's frees (which Retry-After's rate counts)."""
        return turn * max(1, self.layout.live(model))

    def capacity(self, model: str) -> int:
        """The slots of `model`'s endpoints in rotation, over all its partitions."""
        return self.layout.capacity(model)

    # --- configuration -------------------------------------------------------------------

    def apply(self, registry: Registry, tiers: TiersConfig, on_outage: str | None = None) -> None:
        """A new config (routing/admission/layout.py `Layout.apply`), and the local outage
        shares the new tiers (and the outage its mode, if given)."""
        self._tiers = tiers
        self.local.tiers = tiers
        if on_outage is not None:
            self.outage.mode = on_outage
        for slots in self.layout.apply(registry, tiers):
            self._send_index(slots)
        for model in registry:
            self.local.capacity[model.name] = self.capacity(model.name)

    def set_endpoints(self, model: str, endpoints: Sequence[EndpointSpec]) -> None:
        """The endpoints of `model` now in rotation (`Layout.set_endpoints`). Redis's
        endpoint index learns what changed now once admission started (before, at the first
        acquire or sweep); a write that fails is made whole by the next sweep."""
        for slots in self.layout.set_endpoints(model, endpoints):
            self._send_index(slots)
        self.local.capacity[model] = self.capacity(model)

    def _send_index(self, slots: ModelSlots) -> None:
        if self._started and (call := slots.index()) is not None:
            sent = self.scripts.send(self.store, [call])
            sent.add_done_callback(partial(indexed, slots))

    # --- shutdown ------------------------------------------------------------------------

    async def close(self, timeout_s: float = 5.0) -> None:
        await self.handback.close(timeout_s)

    async def drain(self, timeout_s: float = 5.0) -> None:
        await self.handback.drain(timeout_s)
