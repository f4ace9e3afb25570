"""Rate limits in admission (routing/admission/acquire.py, admit.py, ratelimit.py) against the
real Redis: the take rides a walk's first try, a refusal gives back what the acquire took,
a walk that admits nothing gives its charge back, and a release trues the tokens up."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.runtime.settings import parse_config
from routing.admission.admit import Admission, Admitted
from routing.admission.ratelimit import RateLimits, rate_limits
from routing.admission.tokens import TokenAsk
from routing.errors import Limited, Unavailable
from routing.quotas import Quota, Quotas
from routing.registry import Registry
from routing.store.connect import connect
from routing.store.keys import rate_key
from tests.factories import usage_record
from tests.redis_cluster import RedisCluster
from tests.routing.admission.test_admission import (
    Fleet,
    bounded,
    dead_redis,
    expect_limited,
    intercept,
    riding,
    running,
    spread_cluster,  # noqa: F401 (a fixture, asked for by name)
)
from tiers.policy import Tier

CONFIG = """
tiers:
  default: {queue_timeout_s: 0.5}
models:
  two:
    max_queue: 2
    max_tokens_default: 200
    endpoints:
      - {url: "http://two-a:8000", max_concurrency: 1}
      - {url: "http://two-b:8000", max_concurrency: 1}
  five:
    max_tokens_default: 4000
    endpoints:
      - {url: "http://five-a:8000", max_concurrency: 5}
"""
ACCOUNT = "t-acme"


def limits(**given: int) -> RateLimits:
    made = rate_limits(ACCOUNT, "k1", *(given.get(n) for n in ("rpm", "tpm", "arpm", "atpm")))
    assert made is not None
    return made


@pytest.fixture(params=["resp", "redis-py"])
async def fleet(real_redis: aioredis.Redis, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    config = parse_config(CONFIG, "t.yaml")
    if request.param == "cluster":
        # The account's buckets on another master than the models: the batch spans two.
        cluster: RedisCluster = request.getfixturevalue("spread_cluster")
        inspect = connect(cluster.url, command_timeout_s=2.0)
        built = Fleet(config, Registry(config.models), inspect, store="cluster", cluster=cluster)
    else:
        built = Fleet(config, Registry(config.models), real_redis, store=request.param)
    async with running(built):
        yield built


ON_CLUSTER_TOO = pytest.mark.parametrize(
    "fleet", ["resp", "redis-py", pytest.param("cluster", marks=pytest.mark.slow)], indirect=True
)


async def admit(
    adm: Admission,
    fleet: Fleet,
    *models: str,
    rates: RateLimits | None,
    tokens: TokenAsk | None = None,
    fail_fast: bool = False,
) -> Admitted:
    plan = riding(fleet.plan(*models, fail_fast=fail_fast), Tier.DEFAULT)
    return await bounded(adm.admit(plan, ACCOUNT, 100, tokens=tokens, rates=rates))


async def peek(adm: Admission, rates: RateLimits) -> Quotas:
    return await bounded(adm.rates.peek(rates))


def calls_named(adm: Admission) -> list[str]:
    """The names of the calls this replica sends, as it sends them."""
    names: list[str] = []

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        names.extend(str(name) for name, _, _ in calls)
        return await send()

    intercept(adm, around)
    return names


@ON_CLUSTER_TOO
async def test_a_key_gets_its_rpm_then_429_with_what_is_left(fleet: Fleet) -> None:
    adm = await fleet.admission()
    rates = limits(rpm=2)
    first = await admit(adm, fleet, "five", rates=rates)
    assert first.rate is not None and first.rate.quotas.requests == Quota(2, 1, 30_000)
    await bounded(adm.release(first.lease, None, first.rate))
    second = await admit(adm, fleet, "five", rates=rates)
    await bounded(adm.release(second.lease, None, second.rate))
    refused = await expect_limited(admit(adm, fleet, "five", rates=rates), "rate_limit_requests")
    assert 1 <= refused.retry_after_s <= 30
    assert refused.model == "five"
    assert refused.quotas is not None and refused.quotas.requests is not None
    assert (refused.quotas.requests.limit, refused.quotas.requests.remaining) == (2, 0)
    await bounded(adm.drain())
    await fleet.assert_clean()  # the slot the refused request's acquire took went back


async def test_the_take_rides_the_first_try_and_costs_nothing_without_limits(
    fleet: Fleet,
) -> None:
    adm = await fleet.admission()
    for model in ("two", "five"):  # Redis learns the endpoint indexes
        await bounded(adm.release((await admit(adm, fleet, model, rates=None)).lease))
    names = calls_named(adm)
    plain = await admit(adm, fleet, "two", rates=None)
    assert plain.rate is None
    assert names == ["acquire"]  # one call, as before rate limits
    await bounded(adm.release(plain.lease))
    held = [await admit(adm, fleet, "two", rates=None) for _ in range(2)]
    names.clear()
    # "two" is full: the walk falls back to "five"; the take went with the first try only.
    got = await admit(adm, fleet, "two", "five", rates=limits(rpm=5))
    assert got.lease.model == "five"
    assert names[:2] == ["ratelimit", "acquire"] and names.count("ratelimit") == 1
    for done in [*held, got]:
        await bounded(adm.release(done.lease, None, done.rate))
    left = (await peek(adm, limits(rpm=5))).requests
    assert left is not None and (left.limit, left.remaining) == (5, 4)


@ON_CLUSTER_TOO
async def test_a_walk_that_admits_nothing_is_not_charged(fleet: Fleet) -> None:
    adm = await fleet.admission()
    rates = limits(rpm=1, tpm=1000)
    held = [await admit(adm, fleet, "two", rates=None) for _ in range(2)]
    ask = TokenAsk(100, 50)
    busy = await expect_limited(
        admit(adm, fleet, "two", rates=rates, tokens=ask, fail_fast=True), "model_busy"
    )
    # The charge went back: the error says so, and the buckets do.
    assert busy.quotas == Quotas(Quota(1, 1, 0), Quota(1000, 1000, 0))
    await bounded(adm.drain())
    assert await peek(adm, rates) == Quotas(Quota(1, 1, 0), Quota(1000, 1000, 0))
    for lease in held:
        await bounded(adm.release(lease.lease))
    got = await admit(adm, fleet, "two", rates=rates, tokens=ask)  # its one request is there
    await bounded(adm.release(got.lease, None, got.rate))
    await bounded(adm.drain())
    await fleet.assert_clean()


async def test_a_queue_timeout_is_not_charged_either(fleet: Fleet) -> None:
    adm = await fleet.admission()
    await fleet.keeper(adm)
    held = [await admit(adm, fleet, "two", rates=None) for _ in range(2)]
    await expect_limited(admit(adm, fleet, "two", rates=limits(rpm=1)), "queue_timeout")
    await bounded(adm.drain())
    assert (await peek(adm, limits(rpm=1))).requests == Quota(1, 1, 0)
    for lease in held:
        await bounded(adm.release(lease.lease))


async def test_tokens_charge_the_reservation_and_the_release_trues_it_up(fleet: Fleet) -> None:
    adm = await fleet.admission()
    rates = limits(tpm=1000, atpm=5000)
    # Prompt 100, answer asked 500 but capped at the model's max_tokens_default (200).
    got = await admit(adm, fleet, "two", "five", rates=rates, tokens=TokenAsk(100, 500))
    assert got.rate is not None and got.rate.tokens == 300
    assert got.rate.quotas.tokens is not None and got.rate.quotas.tokens.remaining == 700
    record = usage_record(prompt_tokens=60, completion_tokens=40, account=ACCOUNT).to_fields()
    await bounded(adm.release(got.lease, record, got.rate))
    tokens = (await peek(adm, rates)).tokens
    assert tokens is not None and (tokens.limit, tokens.remaining) == (1000, 900)
    # No max_tokens: the model's default is reserved.
    again = await admit(adm, fleet, "two", rates=rates, tokens=TokenAsk(100))
    assert again.rate is not None and again.rate.tokens == 300
    await bounded(adm.release(again.lease, None, again.rate))  # no record: no true-up
    tokens = (await peek(adm, rates)).tokens
    assert tokens is not None and (tokens.limit, tokens.remaining) == (1000, 600)


async def test_a_request_larger_than_the_bucket_never_takes_a_slot(fleet: Fleet) -> None:
    adm = await fleet.admission()
    rates = limits(tpm=1000)
    refused = await expect_limited(
        admit(adm, fleet, "five", rates=rates, tokens=TokenAsk(10, 2000)), "rate_limit_tokens"
    )
    assert not refused.retryable and "can never be served" in refused.message
    await bounded(adm.drain())
    await fleet.assert_clean()
    assert not await fleet.redis.exists(rate_key(ACCOUNT))


async def test_a_caller_gone_during_the_take_gets_its_charge_back(fleet: Fleet) -> None:
    adm = await fleet.admission()
    gate = asyncio.Event()
    sent = asyncio.Event()

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        if calls and calls[0][0] == "ratelimit":
            sent.set()
            await gate.wait()
        return await send()

    intercept(adm, around)
    rates = limits(rpm=3)
    walk = asyncio.create_task(admit(adm, fleet, "two", rates=rates))
    await bounded(sent.wait())
    walk.cancel()
    with pytest.raises(asyncio.CancelledError):
        await walk
    gate.set()
    await bounded(adm.drain())
    assert (await peek(adm, rates)).requests == Quota(3, 3, 0)
    await fleet.assert_clean()


async def test_redis_away_admits_on_the_local_share_without_a_charge(fleet: Fleet) -> None:
    rates = limits(rpm=1, tpm=10)
    reject = await fleet.admission(redis=dead_redis(fleet))
    with pytest.raises(Unavailable) as caught:
        await admit(reject, fleet, "two", rates=rates)
    assert caught.value.quotas == rates.unknown()  # the limits alone: Redis said nothing
    local = await fleet.admission(on_outage="local", redis=dead_redis(fleet))
    local.local.saw([local.replica_id])
    got = await admit(local, fleet, "two", rates=rates, tokens=TokenAsk(5))
    assert got.lease.local and got.rate is None
    await bounded(local.release(got.lease, None, got.rate))


async def test_an_unknown_candidate_error_still_carries_the_quotas(fleet: Fleet) -> None:
    """A walk whose every candidate has no endpoint sent no take: no quotas, so its answer
    reads the buckets (docs/api.md: every answer carries limit, remaining and reset), not the
    limits alone, which are for a take Redis did not answer."""
    adm = await fleet.admission()
    adm.set_endpoints("two", [])
    with pytest.raises(Unavailable) as caught:
        await admit(adm, fleet, "two", rates=limits(rpm=4))
    assert caught.value.quotas is None
    assert await peek(adm, limits(rpm=4)) == Quotas(Quota(4, 4, 0))
    with pytest.raises(Limited):  # a refusal carries what the buckets said
        for _ in range(5):
            got = await admit(adm, fleet, "five", rates=limits(rpm=4))
            await bounded(adm.release(got.lease, None, got.rate))
