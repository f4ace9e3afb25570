"""Waiters live by their replica's word (docs/architecture.md, "Waiter liveness is the
replica's"), done for real with two replicas: one stopped (SIGSTOP) past the waiter TTL gets
its waiters back at their places. Read from the worker's own counters (q: capacity 1) and
from Redis itself. (More scenes of this kind were run when this was built and held, and are
left out of the suite for its time: a replica stopped 2.5, 5.5 and 9 s with waiters, stopped
twice under traffic, killed -9 (tests/e2e/test_stopped_replica.py has its own), Redis shut
down and back under two replicas' waiters, a grant while the subscription backs off
(tests/routing/admission/test_keeper_naming.py has its unit test).)
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import cast

import httpx
import pytest
import redis.asyncio as aioredis

from tests.e2e import procs
from tests.e2e.test_faults import (
    KEY,
    KEY_TWO,
    KEYS_YAML,
    held,
    leftovers,
    long_sim,
    post,
    until,
)
from tests.e2e.test_faults import worker_load as load
from tests.e2e.test_stopped_replica import (
    COMMAND_TIMEOUT_S,
    LEASE_TTL_S,
    SLACK_S,
    SWEEP_S,
    WAITER_TTL_S,
)
from tests.redis_server import RedisServer

QUEUE = "gw:v2:{q}:queue"


@dataclass
class Pair:
    redis: RedisServer
    replicas: list[procs.Proc]
    single: procs.Proc  # q: one endpoint of 1 (it would take 4)


def one_slot(redis_url: str, single_url: str, lease_ttl_s: float, timeout_s: float) -> str:
    """A fleet's config: model q on one endpoint of one slot, its waiters waiting 30 s."""
    return f"""
redis: {{url: "{redis_url}", lease_ttl_s: {lease_ttl_s}, command_timeout_s: {timeout_s}}}
tiers:
  default: {{queue_timeout_s: 30}}
models:
  q: {{endpoints: [{{url: "{single_url}", max_concurrency: 1, model: m1}}]}}
{KEYS_YAML}"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp: Path = tmp_path_factory.mktemp("liveness")
    server = RedisServer(tmp).start()
    started: list[procs.Proc] = []
    try:
        single = long_sim(tmp, 4)
        started.append(single)
        config = one_slot(server.url, single.url, LEASE_TTL_S, COMMAND_TIMEOUT_S)
        replicas = [procs.gateway(tmp, config) for _ in range(2)]
        started += replicas
        yield Pair(server, replicas, single)
    finally:
        stop_all(started, server)


def stop_all(started: list[procs.Proc], server: RedisServer) -> None:
    """Every process started (resumed first if stopped), then Redis."""
    for proc in started:
        if proc.popen is not None and proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGCONT)
        proc.stop()
    server.stop()


async def settle(tasks: list[asyncio.Task[httpx.Response]], client: aioredis.Redis) -> None:
    """Whatever request is still on its way cut, the client closed."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.aclose()


async def queued(client: aioredis.Redis, count: int) -> bool:
    return int(await client.zcard(QUEUE)) == count


async def clean(redis_url: str, limit_s: float) -> None:
    """Nothing of q left in Redis within `limit_s`."""
    left: list[str] = []

    async def nothing() -> bool:
        left[:] = await leftovers(redis_url, ("q",))
        return not left

    try:
        await until(nothing, "Redis to hold nothing", limit_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {left}") from None


async def queue_up(
    client: aioredis.Redis, urls: list[str], keys: list[str]
) -> list[asyncio.Task[httpx.Response]]:
    """One waiter per url (in order), each queued before the next is sent."""
    tasks: list[asyncio.Task[httpx.Response]] = []
    for n, (url, key) in enumerate(zip(urls, keys, strict=True), start=1):
        tasks.append(asyncio.create_task(post(url, "q", key=key, max_tokens=20)))
        await until(partial(queued, client, n), f"waiter {n}", 5)
    return tasks


async def test_a_replica_stopped_past_the_waiter_ttl_gets_its_waiters_back_in_order(
    pair: Pair,
) -> None:
    """q held on A; B queues first, A second. B is stopped past the waiter TTL (its waiter
    leaves the queue), then resumed while the slot is still held: its waiter is back ahead
    of A's within a round or two, and B's is served first once the stream ends."""
    a, b = pair.replicas
    assert b.popen is not None
    client = aioredis.from_url(pair.redis.url)
    tasks: list[asyncio.Task[httpx.Response]] = []
    try:
        async with held(a.url, "q"):
            tasks += await queue_up(client, [b.url, a.url], [KEY_TWO, KEY])
            order = [m.decode() for m in cast(list[bytes], await client.zrange(QUEUE, 0, -1))]
            b.popen.send_signal(signal.SIGSTOP)
            try:
                await until(lambda: queued(client, 1), "B's waiter buried", WAITER_TTL_S + 3)
            finally:
                b.popen.send_signal(signal.SIGCONT)
            await until(lambda: queued(client, 2), "B's waiter back", 3 * SWEEP_S + SLACK_S)
            assert [
                m.decode() for m in cast(list[bytes], await client.zrange(QUEUE, 0, -1))
            ] == order
        answers = await asyncio.wait_for(asyncio.gather(*tasks), 20)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    assert load(pair.single)["sim:peak_requests_running"] <= 1
    await clean(pair.redis.url, LEASE_TTL_S + SLACK_S)
