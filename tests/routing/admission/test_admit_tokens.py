"""Token budgets in admission (docs/api.md, token budgets): what a request reserves, the
400 for one no endpoint could ever hold, the fallback past a model too small for it, and
the lease and record that carry the reservation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.runtime.settings import parse_config
from routing.admission.admit import Admission
from routing.admission.plan import Candidate, plan_candidates
from routing.admission.tokens import TokenAsk
from routing.errors import TooLarge
from routing.registry import Registry
from routing.store.connect import RedisPyStore
from routing.store.keys import account_key
from routing.store.wire import text

CONFIG = """
models:
  small:
    max_tokens_default: 100
    endpoints:
      - {url: "http://small-a:8000", max_concurrency: 4, max_tokens_in_flight: 1000}
      - {url: "http://small-b:8000", max_concurrency: 4, max_tokens_in_flight: 2000}
  big:
    max_tokens_default: 500
    endpoints:
      - {url: "http://big-a:8000", max_concurrency: 4, max_tokens_in_flight: 100000}
  plain:
    endpoints:
      - {url: "http://plain-a:8000", max_concurrency: 4}
"""


@pytest.fixture
async def admission(real_redis: aioredis.Redis) -> AsyncIterator[Admission]:
    config = parse_config(CONFIG, "t.yaml")
    adm = Admission(
        RedisPyStore(real_redis, 2.0), Registry(config.models), config.tiers,
        lease_ttl_s=30, on_outage="reject",
    )  # fmt: skip
    await adm.start()
    try:
        yield adm
    finally:
        await adm.close()


def plan(adm: Admission, *models: str) -> list[Candidate]:
    registry = Registry(parse_config(CONFIG, "t.yaml").models)
    return plan_candidates(
        models[0], list(models), fail_fast=False, registry=registry, allowed=None
    )


async def reserved(real_redis: aioredis.Redis, model: str) -> dict[str, int]:
    raw = await real_redis.hgetall("gw:v2:{" + model + "}:ep_tok")
    return {text(k): int(v) for k, v in raw.items() if int(v)}


async def test_a_request_reserves_its_prompt_and_its_capped_answer(
    admission: Admission, real_redis: aioredis.Redis
) -> None:
    asked = TokenAsk(prompt=300, output=5000)  # its answer capped at small's default, 100
    admitted = await asyncio.wait_for(
        admission.admit(plan(admission, "small"), "acme", 10, tokens=asked), 5
    )
    assert admitted.lease.tokens == 400
    assert await reserved(real_redis, "small") == {admitted.lease.endpoint: 400}
    await admission.release(admitted.lease)
    await asyncio.wait_for(admission.drain(), 5)
    assert await reserved(real_redis, "small") == {}


async def test_a_request_no_endpoint_could_hold_is_refused_without_queueing(
    admission: Admission, real_redis: aioredis.Redis
) -> None:
    asked = TokenAsk(prompt=1950, output=None)  # 1950 + 100: more than small's largest, 2000
    with pytest.raises(TooLarge) as refused:
        await asyncio.wait_for(
            admission.admit(plan(admission, "small"), "acme", 10, tokens=asked), 5
        )
    assert (refused.value.needed, refused.value.budget) == (2050, 2000)
    assert "2000 tokens" in refused.value.message
    assert not await real_redis.exists("gw:v2:{small}:queue", "gw:v2:{small}:leases")
    assert await real_redis.zcard(account_key("acme")) == 0  # the account's entry went back


async def test_the_walk_goes_past_a_model_too_small_for_the_request(
    admission: Admission,
) -> None:
    asked = TokenAsk(prompt=5000, output=10)
    admitted = await asyncio.wait_for(
        admission.admit(plan(admission, "small", "big"), "acme", 10, tokens=asked), 5
    )
    assert admitted.candidate.model.name == "big"
    assert admitted.lease.tokens == 5010
    await admission.release(admitted.lease)


async def test_a_model_without_budgets_reserves_nothing(admission: Admission) -> None:
    admitted = await asyncio.wait_for(
        admission.admit(plan(admission, "plain"), "acme", 10, tokens=TokenAsk(10**6, None)), 5
    )
    assert admitted.lease.tokens == 0
    assert "~" in admitted.lease.id and admitted.lease.id.count("~") == 2  # no tokens in it
    await admission.release(admitted.lease)


def test_each_of_n_answers_reserves_its_own_sequence_beside_one_prompt() -> None:
    # n answers share the prompt's blocks (one prefill), each holds its own answer's.
    assert TokenAsk(prompt=100, output=50, sequences=3).reservation(1024) == 100 + 3 * 50
    assert TokenAsk(prompt=100, output=None, sequences=2).reservation(64) == 100 + 2 * 64
    assert TokenAsk(prompt=100, output=5000, sequences=4).reservation(64) == 100 + 4 * 64
