"""Each replica's background work for admission.

- One pub/sub subscription wakes this replica's waiters by id (no polling loops).
- A slow sweep (about a second) reclaims expired leases and hands their slots on, so that
  capacity held by a dead replica flows back; keeps this replica's leases alive (long
  streams included); finds grants whose wake-up message was lost; and reads each model's
  in-flight and queue depth for metrics and the rate of freed slots for Retry-After.
- A spool round (about a second, its own loop) sends spooled usage records and trims the
  stream (routing/ledger.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from routing.admission import STORE_ERRORS, Admission
from routing.background import BackgroundErrors, every
from routing.ledger import store_sender
from routing.resp import RespClient
from routing.slots import Call, ModelState, model_state, text

log = logging.getLogger("gateway.admission")

REPLICAS_KEY = "gw:replicas"
# A Redis call unanswered this long means a hung server or a dead link: drop the connection.
STALLED_S = 5.0
# A spool round longer than this (a stalled Redis) is cut; what it did not send stays spooled.
SPOOL_ROUND_S = 30.0
# Weight of the newest sample in the freed-slots rate (per sweep).
RATE_WEIGHT = 0.3


@dataclass
class Keeper:
    admission: Admission
    # A connection for the subscription that no socket timeout cuts (redis-py #2807).
    pubsub_redis: aioredis.Redis
    interval_s: float = 1.0
    states: dict[str, ModelState] = field(default_factory=dict)
    store_ok: bool = True
    errors: BackgroundErrors = field(default_factory=BackgroundErrors)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _last_freed: dict[str, tuple[float, int]] = field(default_factory=dict)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        spool = every(
            "spool", self.interval_s, self._tend_spool, self.errors, timeout_s=SPOOL_ROUND_S
        )
        self._tasks = [
            loop.create_task(self._listen()),
            loop.create_task(self._sweeping()),
            loop.create_task(spool),
        ]

    def resubscribe(self) -> None:
        """The set of models changed: listen on every model's channel from now on."""
        if self._tasks:
            self._tasks[0].cancel()
            self._tasks[0] = asyncio.get_running_loop().create_task(self._listen())

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _sweeping(self) -> None:
        while True:
            try:
                await self.sweep_once()
                self.store_ok = True
            except STORE_ERRORS as exc:
                if self.store_ok:
                    log.warning("admission store unreachable: %s", type(exc).__name__)
                self.store_ok = False
            await asyncio.sleep(self.interval_s)

    async def _tend_spool(self) -> None:
        adm = self.admission
        if adm.spool is not None:
            await adm.spool.tend(store_sender(adm.scripts, adm.store))

    async def sweep_once(self) -> None:
        adm = self.admission
        models = list(adm.slots)
        calls: list[Call] = [adm.slots[m].sweep() for m in models]
        ttl = max(3000, int(self.interval_s * 3000))
        calls.append(("heartbeat", [REPLICAS_KEY], [adm.replica_id, ttl]))
        calls += self._refresh_calls()
        lost = self._waiting_by_model()
        calls += [("HMGET", [adm.slots[m].granted_key], ids) for m, ids in lost.items()]
        if isinstance(adm.store, RespClient) and adm.store.fail_stalled(STALLED_S):
            log.warning("Redis did not answer for %ss; reconnecting", STALLED_S)
        replies = await adm.scripts.execute(adm.store, calls)
        now = asyncio.get_running_loop().time()
        for model, reply in zip(models, replies, strict=False):
            state = model_state(reply)
            self.states[model] = state
            self._track_rate(model, now, state.freed)
        adm.replicas = max(1, int(replies[len(models)]))
        lost_replies = replies[len(replies) - len(lost) :]
        for ids, granted in zip(lost.values(), lost_replies, strict=True):
            for waiter_id, endpoint in zip(ids, granted, strict=True):
                if endpoint is not None:
                    self.wake(waiter_id, text(endpoint))

    def _refresh_calls(self) -> list[Call]:
        by_model: dict[str, list[str]] = defaultdict(list)
        by_account: dict[str, list[str]] = defaultdict(list)
        for lease in self.admission.held.values():
            if not lease.local:
                by_model[lease.model].append(lease.id)
                by_account[lease.account].append(lease.id)
        calls: list[Call] = [self.admission.slots[m].refresh(ids) for m, ids in by_model.items()]
        ttl = self.admission.ttl_ms
        calls += [("refresh", [key], [ttl, *ids]) for key, ids in by_account.items()]
        return calls

    def _waiting_by_model(self) -> dict[str, list[str]]:
        waiting: dict[str, list[str]] = defaultdict(list)
        for waiter_id, (model, future) in self.admission.waiters.items():
            if not future.done():
                waiting[model].append(waiter_id)
        return dict(waiting)

    def _track_rate(self, model: str, now: float, freed: int) -> None:
        previous = self._last_freed.get(model)
        self._last_freed[model] = (now, freed)
        if previous is None or now <= previous[0] or freed < previous[1]:
            return
        sample = (freed - previous[1]) / (now - previous[0])
        old = self.admission.freed_rate.get(model)
        rate = sample if old is None else old + RATE_WEIGHT * (sample - old)
        self.admission.freed_rate[model] = rate

    def wake(self, waiter_id: str, endpoint: str) -> None:
        entry = self.admission.waiters.get(waiter_id)
        if entry is not None and not entry[1].done():
            entry[1].set_result(endpoint)

    async def _listen(self) -> None:
        channels = [s.channel for s in self.admission.slots.values()]
        backoff = 0.2
        while True:
            pubsub = self.pubsub_redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(*channels)
                backoff = 0.2
                while True:
                    message = await pubsub.get_message(timeout=5.0)
                    if message is not None:
                        self._on_message(message)
            except STORE_ERRORS as exc:
                log.warning("wake-up subscription lost (%s); resubscribing", type(exc).__name__)
            finally:
                # Bounded: redis-py's close of a pub/sub interrupted mid-read can hang.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_close_quietly(pubsub), 1.0)
            await asyncio.sleep(backoff)
            backoff = min(5.0, backoff * 2)

    def _on_message(self, message: dict[str, Any]) -> None:
        waiter_id, _, endpoint = text(message.get("data")).partition(" ")
        if endpoint:
            self.wake(waiter_id, endpoint)


async def _close_quietly(pubsub: Any) -> None:
    with contextlib.suppress(*STORE_ERRORS):
        await pubsub.aclose()
