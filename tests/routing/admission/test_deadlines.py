"""Deadlines in admission (docs/api.md, deadlines): with the model's service rate known, a
request whose estimated wait passes its deadline is refused at once and never queued (read
from the scripts' own state, not a clock); a queued request whose deadline passes leaves
the queue then, answered `deadline_unreachable`, not `queue_timeout`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.runtime.settings import parse_config
from routing.admission.admit import Admission, Admitted
from routing.admission.keeper import Keeper
from routing.admission.plan import Candidate, plan_candidates
from routing.errors import Limited, LimitReason
from routing.registry import Registry
from routing.store.connect import RedisPyStore
from tests.conftest import REDIS_URL

CONFIG = """
tiers:
  default: {queue_timeout_s: 30}
models:
  dl:
    endpoints:
      - {url: "http://dl-a:8000", max_concurrency: 1}
"""


@pytest.fixture
async def admission(real_redis: aioredis.Redis) -> AsyncIterator[Admission]:
    """An admission with its keeper (the subscription wakes its waiters)."""
    config = parse_config(CONFIG, "t.yaml")
    adm = Admission(
        RedisPyStore(real_redis, 2.0), Registry(config.models), config.tiers,
        lease_ttl_s=30, on_outage="reject",
    )  # fmt: skip
    await adm.start()
    pubsub = aioredis.Redis.from_url(REDIS_URL)
    keeper = Keeper(adm, pubsub, interval_s=5.0)  # one sweep at its start: the rate stays set
    await keeper.start()
    try:
        yield adm
    finally:
        await keeper.close()
        await adm.close()
        await pubsub.aclose()


def plan() -> list[Candidate]:
    registry = Registry(parse_config(CONFIG, "t.yaml").models)
    return plan_candidates("dl", None, fail_fast=False, registry=registry, allowed=None)


async def admit(adm: Admission, name: str, deadline_s: float | None = None) -> Admitted:
    return await adm.admit(plan(), name, 10, deadline_s=deadline_s)


async def queued(real_redis: aioredis.Redis) -> int:
    return int(await real_redis.zcard("gw:v2:{dl}:queue"))


async def until_queued(real_redis: aioredis.Redis, n: int) -> None:
    """Another task's acquire has no event to wait on here: the queue is polled, bounded."""

    async def poll() -> None:
        while await queued(real_redis) < n:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), 5)


async def test_a_wait_past_the_deadline_is_refused_at_once_without_queueing(
    admission: Admission, real_redis: aioredis.Redis
) -> None:
    held = await asyncio.wait_for(admit(admission, "a"), 5)  # the model's one slot
    # Known: one slot freed a second. Two waiters ahead: a newcomer's turn comes in ~3 s.
    admission.retry.freed_rate["dl"] = 1.0
    waiters = [asyncio.ensure_future(admit(admission, f"w{i}")) for i in range(2)]
    await until_queued(real_redis, 2)
    with pytest.raises(Limited) as refused:
        await asyncio.wait_for(admit(admission, "late", deadline_s=1.5), 5)
    assert refused.value.reason is LimitReason.DEADLINE_UNREACHABLE
    assert refused.value.wait_estimate_s == pytest.approx(3.0)
    assert 1 <= refused.value.retry_after_s <= 60
    assert await queued(real_redis) == 2  # it never entered the queue
    # One whose deadline the estimate meets queues as any other.
    fits = asyncio.ensure_future(admit(admission, "fits", deadline_s=10.0))
    await until_queued(real_redis, 3)
    admission.release(held.lease)
    for task in [*waiters, fits]:
        admitted = await asyncio.wait_for(task, 10)
        admission.release(admitted.lease)
    await asyncio.wait_for(admission.drain(), 5)


async def test_a_queued_request_leaves_when_its_deadline_passes(
    admission: Admission, real_redis: aioredis.Redis
) -> None:
    """Before any rate is known only the deadline's own timer ends the wait: it leaves the
    queue, answered deadline_unreachable (its tier's 30 s timeout did not)."""
    held = await asyncio.wait_for(admit(admission, "a"), 5)
    waiter = asyncio.ensure_future(admit(admission, "w", deadline_s=0.3))
    with pytest.raises(Limited) as refused:
        await asyncio.wait_for(waiter, 5)
    assert refused.value.reason is LimitReason.DEADLINE_UNREACHABLE
    assert await queued(real_redis) == 0
    admission.release(held.lease)
    await asyncio.wait_for(admission.drain(), 5)
