"""A waiter whose queue timeout falls inside a Redis stall (SIGSTOP: the connection stays
open, nothing answers) is answered within its command timeout, not when Redis comes back;
and what it left in Redis is forgotten afterwards. On a Redis of the test's own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.runtime.settings import parse_config
from routing.admission.admit import Admission
from routing.admission.holdings import FORGET_ROUNDS
from routing.admission.keeper import Keeper
from routing.admission.plan import plan_candidates
from routing.errors import Limited, Unavailable
from routing.registry import Registry
from routing.store.resp import RespClient
from tests.redis_server import RedisServer
from tests.routing.admission.test_admission import watch_queued

QUEUE_TIMEOUT_S = 1.0
COMMAND_TIMEOUT_S = 0.5
# What a loaded test machine may add on top; a wait for Redis to come back would add the
# whole stall (held until the answer is in).
SLACK_S = 1.0
CONFIG = f"""
redis: {{url: "redis://unused", lease_ttl_s: 30, command_timeout_s: {COMMAND_TIMEOUT_S}}}
tiers: {{default: {{queue_timeout_s: {QUEUE_TIMEOUT_S}}}}}
models:
  m: {{endpoints: [{{url: "http://127.0.0.1:9/a", max_concurrency: 1, model: m}}]}}
"""


@pytest.fixture
async def replica(tmp_path: Path) -> AsyncIterator[tuple[RedisServer, Admission, Keeper]]:
    server = RedisServer(tmp_path).start()
    config = parse_config(CONFIG, "stall.yaml")
    store = RespClient(server.url, command_timeout_s=COMMAND_TIMEOUT_S)
    adm = Admission(
        store, Registry(config.models), config.tiers, lease_ttl_s=30, on_outage="reject",
        sweep_interval_s=0.25, command_timeout_s=COMMAND_TIMEOUT_S,
    )  # fmt: skip
    await adm.start()
    keeper = Keeper(adm, aioredis.Redis.from_url(server.url), interval_s=0.25)
    try:
        yield server, adm, keeper
    finally:
        server.resume()
        await keeper.close()
        await adm.close()
        await store.aclose()
        server.stop()


def plan() -> Any:
    registry = Registry(parse_config(CONFIG, "stall.yaml").models)
    return plan_candidates("m", None, fail_fast=False, registry=registry, allowed=None)


@pytest.mark.slow
@pytest.mark.parametrize("stall_s", [None, 0.3], ids=["through-the-timeout", "short"])
async def test_a_waiter_timing_out_in_a_stall_is_answered_in_time(
    replica: tuple[RedisServer, Admission, Keeper], stall_s: float | None
) -> None:
    server, adm, keeper = replica
    queued = watch_queued(adm)
    held = await asyncio.wait_for(adm.admit(plan(), "acct", 10), 5)  # the only slot
    waiter = asyncio.create_task(adm.admit(plan(), "acct", 10))
    await asyncio.wait_for(queued.get(), 5)
    started = time.monotonic()
    server.pause()
    if stall_s is not None:
        await asyncio.sleep(stall_s)  # the stall itself, not a synchronisation
        server.resume()
    with pytest.raises((Unavailable, Limited)) as refused:
        await asyncio.wait_for(waiter, 10)
    waited = time.monotonic() - started
    server.resume()
    # Through the timeout: the cancel meets the stall and fails at its deadline (503); a
    # short stall is over by then: the cancel runs and the answer is the queue timeout.
    assert isinstance(refused.value, Unavailable if stall_s is None else Limited)
    assert waited < QUEUE_TIMEOUT_S + COMMAND_TIMEOUT_S + SLACK_S, waited
    await asyncio.wait_for(adm.release(held.lease), 5)
    # Whatever the failed cancel left (the waiter's place) is forgotten by the sweeps.
    for _ in range(FORGET_ROUNDS):
        await asyncio.wait_for(keeper.sweep_once(), 5)
    client = aioredis.Redis.from_url(server.url)
    try:
        assert await client.zcard("gw:v2:{m}:queue") == 0
        assert await client.zcard("gw:v2:{m}:leases") == 0
    finally:
        await client.aclose()
