"""Fleet-wide admission (SPEC 4 and 5): slots leased in Redis, a tiered queue, precise 429s.

`Admission.admit` walks the request's candidates (routing.plan) and returns a `Lease` on one
model's endpoint, or raises `RateLimited` with the last entry's reason. Every path out of a
request calls `release` (shielded from cancellation). The Redis protocol lives in
routing/slots.py and the Lua files; the background work (sweep, keep-alive, wake-ups) in
routing/keeper.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.errors import GatewayError, RateLimited, ServiceUnavailable
from routing.ledger import DEFAULT_RETENTION_S, UsageSpool, record_call, store_sender
from routing.plan import Candidate
from routing.registry import Model, Registry
from routing.slots import (
    BUSY,
    FULL,
    GRANTED,
    QUEUED,
    Attempt,
    ModelSlots,
    Scripts,
    Store,
    account_key,
    attempt,
    text,
)
from tiers.policy import Tier, TiersConfig

log = logging.getLogger("gateway.admission")
T = TypeVar("T")

STORE_ERRORS = (RedisError, OSError)
# Past this, a computed Retry-After says more about noise than about the queue.
MAX_RETRY_AFTER_S = 60


@dataclass(slots=True)
class Lease:
    """A slot held on one endpoint of one model (and in the account's own count)."""

    id: str
    model: str
    endpoint: str
    account: str
    queued_ms: float
    local: bool = False


@dataclass(frozen=True, slots=True)
class Admitted:
    lease: Lease
    candidate: Candidate
    tier: Tier


class Admission:
    def __init__(
        self,
        redis: aioredis.Redis,
        registry: Registry,
        tiers: TiersConfig,
        *,
        lease_ttl_s: float,
        on_outage: str,
        store: Store | None = None,
        spool: UsageSpool | None = None,
        replica_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        # Where the scripts run: the lean pipelining client when the URL allows it.
        self.store: Store = store if store is not None else redis
        self.spool = spool
        self.scripts = Scripts()
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.ttl_ms = int(lease_ttl_s * 1000)
        self.on_outage = on_outage
        self._tiers = tiers
        self._clock = clock
        self._ids = itertools.count()
        self.slots = {m.name: _slots(m, tiers, self.ttl_ms) for m in registry}
        self.held: dict[str, Lease] = {}
        self.waiters: dict[str, tuple[str, asyncio.Future[str]]] = {}
        # Slots freed per second, per model, fleet-wide (fed by the keeper's sweep).
        self.freed_rate: dict[str, float] = {}
        self.replicas = 1
        self.local = LocalShares(registry, tiers)
        # Work still on its way that close() must wait for: clean-up tasks, releases, and
        # calls whose caller was cancelled (their undo starts when they answer).
        self._tasks: set[asyncio.Task[Any]] = set()
        self._releases: set[asyncio.Future[None]] = set()
        self._cleanups: set[asyncio.Future[Any]] = set()

    async def start(self) -> None:
        try:
            await self.scripts.load(self.store)
        except STORE_ERRORS as exc:  # not fatal: loaded again on first use (NOSCRIPT)
            log.warning("admission store unreachable at start: %s", type(exc).__name__)

    async def admit(
        self,
        candidates: Sequence[Candidate],
        tier_of: Callable[[Model], Tier],
        account: str,
        account_limit: int,
        affinity: Callable[[Model], Sequence[str] | None] | None = None,
    ) -> Admitted:
        walk = _Walk(f"{self.replica_id}-{next(self._ids)}", account, account_limit, affinity)
        started = self._clock()
        try:
            last: GatewayError | None = None
            for cand in candidates:
                tier = tier_of(cand.model)
                if self.slots[cand.model.name].capacity == 0:
                    last = ServiceUnavailable(f"{cand.model.name!r} has no healthy endpoint.")
                    continue
                result = await self._try(walk, cand, tier)
                endpoint = await self._settle(cand, tier, walk.lease_id, result)
                if endpoint is not None:
                    queued = (self._clock() - started) * 1000
                    lease = Lease(walk.lease_id, cand.model.name, endpoint, walk.akey, queued)
                    self.held[walk.lease_id] = lease
                    walk.holds_account = False  # the lease owns it now
                    return Admitted(lease, cand, tier)
                last = self._rejection(cand.model, tier, result)
            assert last is not None
            raise last
        except STORE_ERRORS as exc:
            return self._outage(candidates, tier_of, walk.lease_id, walk.akey, exc)
        finally:
            self.waiters.pop(walk.lease_id, None)
            if walk.holds_account:
                self._spawn(self._forget_account(walk.akey, walk.lease_id))

    async def _try(self, walk: _Walk, cand: Candidate, tier: Tier) -> Attempt:
        """One candidate's acquire; the first also takes the account's own slot, in the same
        round trip (and the model's slot goes back if the account is at its limit)."""
        model = cand.model.name
        call = self._attempt_call(cand, tier, walk.lease_id, walk.affinity)
        if walk.holds_account:
            undo = partial(self._undo_replies, model, walk.lease_id, None)
            replies = await self._outliving(self.scripts.submit(self.store, [call]), undo)
            return attempt(replies[0])
        account_call = ("account", [walk.akey], [walk.lease_id, walk.limit, self.ttl_ms])
        undo = partial(self._undo_replies, model, walk.lease_id, walk.akey)
        replies = await self._outliving(self.scripts.submit(self.store, [account_call, call]), undo)
        walk.holds_account = int(replies[0]) == 1
        result = attempt(replies[1])
        if not walk.holds_account:
            await asyncio.shield(self._spawn(self._undo(model, walk.lease_id, result)))
            raise RateLimited(
                f"Account {walk.account[:64]!r} has {walk.limit} requests in flight.",
                code="concurrency_limit",
                retry_after_s=1,
            )
        return result

    def _attempt_call(
        self,
        cand: Candidate,
        tier: Tier,
        lease_id: str,
        affinity: Callable[[Model], Sequence[str] | None] | None,
    ) -> Any:
        wait_ms = int(self._tiers.policy(tier).queue_timeout_s * 1000)
        if cand.may_wait:
            # Registered before the call: a wake-up may arrive before the reply does.
            self.waiters[lease_id] = (cand.model.name, asyncio.get_running_loop().create_future())
        preferred = affinity(cand.model) if affinity is not None else None
        return self.slots[cand.model.name].acquire(
            lease_id, tier, may_wait=cand.may_wait, wait_ms=wait_ms + 5000, affinity=preferred
        )

    async def _settle(
        self, cand: Candidate, tier: Tier, lease_id: str, result: Attempt
    ) -> str | None:
        """The granted endpoint (at once, or after waiting in the queue), or None."""
        if result.status != QUEUED:
            self.waiters.pop(lease_id, None)
            return result.endpoint if result.status == GRANTED else None
        _, future = self.waiters[lease_id]
        timeout = self._tiers.policy(tier).queue_timeout_s
        try:
            await asyncio.wait({future}, timeout=timeout)
        except asyncio.CancelledError:
            self._spawn(self._abandon(cand.model.name, lease_id))
            raise
        finally:
            self.waiters.pop(lease_id, None)
        if future.done():
            return future.result()
        # Timed out; the slot may have been granted just now (its message still on the way).
        model = cand.model.name
        granted = text(
            (
                await self._outliving(
                    self.scripts.submit(self.store, [self.slots[model].cancel(lease_id)]),
                    partial(self._release_late_grant, model, lease_id),
                )
            )[0]
        )
        if granted:
            return granted
        raise RateLimited(
            f"Waited {timeout:g}s in the queue of {cand.model.name!r} without a free slot.",
            code="queue_timeout",
            retry_after_s=self.retry_after(cand.model.name, 0),
        )

    def _rejection(self, model: Model, tier: Tier, result: Attempt) -> RateLimited:
        retry = self.retry_after(model.name, result.ahead)
        if result.status == FULL:
            message = f"The queue of {model.name!r} is full ({result.ahead} waiting)."
            return RateLimited(message, code="queue_full", retry_after_s=retry)
        assert result.status == BUSY
        if tier is Tier.FLEX:
            message = f"No spare capacity on {model.name!r} for the flex tier."
            return RateLimited(message, code="flex_no_capacity", retry_after_s=retry)
        message = f"{model.name!r} has no free slot ({result.inflight} in flight)."
        return RateLimited(message, code="model_busy", retry_after_s=retry)

    def apply(self, registry: Registry, tiers: TiersConfig) -> None:
        """A new config: new models get slots, known ones new ceilings and queue bounds.
        Models that left keep their slots (their requests in flight still release)."""
        self._tiers = tiers
        utilization = {t: tiers.policy(t).max_utilization for t in Tier}
        for model in registry:
            slots = self.slots.get(model.name)
            if slots is None:
                self.slots[model.name] = _slots(model, tiers, self.ttl_ms)
                self.local.capacity[model.name] = model.capacity
                self.local.inflight.setdefault(model.name, 0)
            else:
                slots.configure(utilization, model.config.max_queue)

    def set_endpoints(self, model: str, endpoints: Sequence[tuple[str, int, float]]) -> None:
        """The endpoints of `model` now in rotation: (url, max_concurrency, load penalty)."""
        self.slots[model].set_endpoints(endpoints)
        self.local.capacity[model] = self.slots[model].capacity

    async def reroute(self, lease: Lease, tier: Tier, unreachable: str) -> bool:
        """Move a held slot off an endpoint that could not be reached, onto another endpoint
        of the same model with room (no waiting). False when there is none; either way the
        request still releases its lease as usual."""
        slots = self.slots[lease.model]
        others = [url for url in slots.urls if url != unreachable]
        calls = [
            slots.release(lease.id),
            slots.acquire(lease.id, tier, may_wait=False, wait_ms=0, only=others),
        ]
        replies = await asyncio.shield(self.scripts.submit(self.store, calls))
        result = attempt(replies[1])
        if result.status != GRANTED:
            return False
        lease.endpoint = result.endpoint
        return True

    def retry_after(self, model: str, ahead: int) -> int:
        """Seconds until a slot is likely free for a newcomer: the queue ahead over the rate
        at which the fleet frees slots of this model."""
        rate = self.freed_rate.get(model, 0.0)
        if rate <= 0.0:
            return 1 + min(ahead, MAX_RETRY_AFTER_S - 1)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil((ahead + 1) / rate)))

    def release(self, lease: Lease, usage: Mapping[str, str] | None = None) -> asyncio.Future[None]:
        """Give the slot back, with the request's usage record in the same round trip. The
        calls leave at once, whatever happens to the caller afterwards; awaiting the
        result (never an error) is optional. A record Redis did not take is spooled."""
        self.held.pop(lease.id, None)
        if usage is not None:
            usage = {**usage, "attempt": lease.id}  # unique per admission, unlike request ids
        released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if lease.local:
            self.local.release(lease.model)
            self._spool(usage)
            released.set_result(None)
            return released
        calls = [self.slots[lease.model].release(lease.id), ("ZREM", [lease.account], [lease.id])]
        if usage is not None:
            retention = self.spool.retention_s if self.spool is not None else DEFAULT_RETENTION_S
            calls.append(record_call(usage, retention))
        try:
            sent = self.scripts.submit(self.store, calls)
        except STORE_ERRORS as exc:
            sent = asyncio.get_running_loop().create_future()
            sent.set_exception(exc)
        sent.add_done_callback(partial(self._released, released, usage))
        self._releases.add(released)
        released.add_done_callback(self._releases.discard)
        return released

    def _released(
        self,
        released: asyncio.Future[None],
        usage: Mapping[str, str] | None,
        sent: asyncio.Future[list[Any]],
    ) -> None:
        if not sent.cancelled() and (exc := sent.exception()) is not None:
            log.warning("release failed (%s); the lease expires by its TTL", type(exc).__name__)
            self._spool(usage)
        if not released.done():
            released.set_result(None)

    def _spool(self, usage: Mapping[str, str] | None) -> None:
        if usage is not None and self.spool is not None:
            self.spool.add(usage)

    async def flush_spool(self) -> int:
        """Send spooled usage records now (the keeper's spool round also does)."""
        return await self.spool.flush(store_sender(self.scripts, self.store)) if self.spool else 0

    async def _outliving(
        self, work: asyncio.Future[T], undo: Callable[[T], Coroutine[Any, Any, None]]
    ) -> T:
        """Await calls already on their way: if the caller is cancelled meanwhile, they still
        finish and `undo` gives back whatever they took (no slot is ever orphaned)."""
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(partial(self._undo_when_done, undo))
            self._cleanups.add(work)
            work.add_done_callback(self._cleanups.discard)
            raise

    def _undo_when_done(
        self, undo: Callable[[T], Coroutine[Any, Any, None]], done: asyncio.Future[T]
    ) -> None:
        if not done.cancelled() and done.exception() is None:
            self._spawn(undo(done.result()))

    async def _undo_replies(
        self, model: str, lease_id: str, akey: str | None, replies: list[Any]
    ) -> None:
        self.waiters.pop(lease_id, None)
        await self._undo(model, lease_id, attempt(replies[-1]))
        if akey is not None and int(replies[0]) == 1:
            await self._forget_account(akey, lease_id)

    async def _release_late_grant(self, model: str, lease_id: str, replies: list[Any]) -> None:
        if text(replies[0]):
            await self.scripts.run(self.store, self.slots[model].release(lease_id))

    async def _undo(self, model: str, lease_id: str, result: Attempt) -> None:
        if result.status == GRANTED:
            await self.scripts.run(self.store, self.slots[model].release(lease_id))
        elif result.status == QUEUED:
            self.waiters.pop(lease_id, None)
            await self._abandon(model, lease_id)

    async def _abandon(self, model: str, lease_id: str) -> None:
        """A waiter leaves (caller gone): out of the queue, or its late grant given back."""
        try:
            slots = self.slots[model]
            if text(await self.scripts.run(self.store, slots.cancel(lease_id))):
                await self.scripts.run(self.store, slots.release(lease_id))
        except STORE_ERRORS as exc:
            log.warning("abandoning a waiter failed (%s); it expires", type(exc).__name__)

    async def _forget_account(self, akey: str, lease_id: str) -> None:
        try:
            await self.scripts.run(self.store, ("ZREM", [akey], [lease_id]))
        except STORE_ERRORS as exc:
            log.warning("account release failed (%s); it expires", type(exc).__name__)

    def _outage(
        self,
        candidates: Sequence[Candidate],
        tier_of: Callable[[Model], Tier],
        lease_id: str,
        akey: str,
        exc: BaseException,
    ) -> Admitted:
        self.waiters.pop(lease_id, None)
        if self.on_outage != "local":
            raise ServiceUnavailable(
                "The admission store (Redis) is unreachable; try again shortly."
            ) from exc
        last: RateLimited | None = None
        for cand in candidates:
            tier = tier_of(cand.model)
            if self.local.take(cand.model.name, tier, self.replicas):
                lease = Lease(lease_id, cand.model.name, "", akey, 0.0, local=True)
                self.held[lease_id] = lease
                return Admitted(lease, cand, tier)
            last = RateLimited(
                f"{cand.model.name!r} has no free slot in this replica's share.",
                code="flex_no_capacity" if tier is Tier.FLEX else "model_busy",
                retry_after_s=1,
            )
        assert last is not None
        raise last

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Give back every slot this replica still holds (best effort) and finish cleanups."""
        for lease in list(self.held.values()):
            self.release(lease)
        await self.drain()

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for releases and clean-ups already on their way (and those they start)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while pending := [*self._tasks, *self._releases, *self._cleanups]:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            await asyncio.wait(pending, timeout=left)


@dataclass(slots=True)
class _Walk:
    """One request's walk over its candidates."""

    lease_id: str
    account: str
    limit: int
    affinity: Callable[[Model], Sequence[str] | None] | None
    holds_account: bool = False

    @property
    def akey(self) -> str:
        return account_key(self.account)


class LocalShares:
    """Admission while Redis is down under `on_outage: local`: this replica's share only."""

    def __init__(self, registry: Registry, tiers: TiersConfig) -> None:
        self.capacity = {m.name: m.capacity for m in registry}
        self._tiers = tiers
        self.inflight: dict[str, int] = dict.fromkeys(self.capacity, 0)

    def take(self, model: str, tier: Tier, replicas: int) -> bool:
        if self.capacity[model] == 0:
            return False
        share = self.capacity[model] / max(1, replicas)
        ceiling = share * self._tiers.policy(tier).max_utilization
        if self.inflight[model] >= max(1.0, math.floor(ceiling)):
            return False
        self.inflight[model] += 1
        return True

    def release(self, model: str) -> None:
        self.inflight[model] -= 1


def _slots(model: Model, tiers: TiersConfig, ttl_ms: int) -> ModelSlots:
    utilization = {t: tiers.policy(t).max_utilization for t in Tier}
    slots = ModelSlots(model.name, utilization, model.config.max_queue, ttl_ms)
    # Every endpoint is in rotation until health checks say otherwise.
    slots.set_endpoints([(e.base_url, e.max_concurrency, 0.0) for e in model.config.endpoints])
    return slots
