"""What a replica admitted on its local share (`redis.on_outage: local`) while Redis was away,
once Redis is back: those requests still run on the workers, so Redis must count them again
(written back by the sweep, as every lease a replica holds: docs/architecture.md, "What
each fault does"), or the replicas admit the whole capacity again on top of them. Read from the
worker's own counters and from Redis itself; one usage record per admission, with its
reservation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import cast

import pytest

from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.e2e.test_faults import (
    COMMAND_TIMEOUT_S,
    KEY,
    LEASE_TTL_S,
    RUN,
    SLACK_S,
    SWEEP_S,
    Refused,
    get,
    held,
    leftovers,
    long_sim,
    redis_of,
    rid,
    until,
    worker_load,
)
from tests.redis_server import RedisServer, StreamEntries

CAPACITY = 2
BUDGET = 100_000  # never binding: every lease reserves tokens all the same


@dataclass
class Local:
    redis: RedisServer
    gateway: procs.Proc
    worker: procs.Proc

    @property
    def url(self) -> str:
        return self.redis.url


@pytest.fixture
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Local]:
    tmp = tmp_path_factory.mktemp("local-leases")
    server = RedisServer(tmp).start()
    started: list[procs.Proc] = []
    try:
        worker = long_sim(tmp, 8)  # takes more than the gateway may give it
        started.append(worker)
        config = f"""
redis: {{url: "{server.url}", lease_ttl_s: {LEASE_TTL_S}, command_timeout_s: {COMMAND_TIMEOUT_S},
        on_outage: local}}
models:
  l:
    endpoints:
      - {{url: "{worker.url}", max_concurrency: {CAPACITY}, model: m1,
          max_tokens_in_flight: {BUDGET}}}
keys: [{{sha256: "{digest(KEY)}", account: faults-acme}}]
"""
        gateway = procs.gateway(tmp, config)
        started.append(gateway)
        yield Local(server, gateway, worker)
    finally:
        for proc in started:
            proc.stop()
        server.stop()


async def _sees_itself(url: str) -> bool:
    return "gateway_replicas 1.0" in (await get(url + "/metrics")).text


async def _ready(url: str) -> bool:
    return (await get(url + "/readyz")).status_code == 200


async def _written_back(local: Local, count: int) -> bool:
    async with redis_of(local) as client:
        return int(await client.zcard("gw:v2:{l}:leases")) >= count


async def test_local_leases_count_again_once_redis_is_back(local: Local) -> None:
    url = local.gateway.url
    await until(lambda: _sees_itself(url), "the replica's first sweep", 5)
    local.redis.kill()
    admitted: set[str] = set()
    async with AsyncExitStack() as streams:
        for _ in range(CAPACITY):  # the whole capacity, on the local share
            request = rid("back")
            await streams.enter_async_context(held(url, "l", rid=request))
            admitted.add(request)
        local.redis.start()  # empty, as a Redis without persistence restarts
        await until(lambda: _ready(url), "readiness", 10)
        # Within a sweep the replica writes back what it holds; not asserted here: the
        # worker's own count below is the promise.
        with contextlib.suppress(AssertionError):
            await until(lambda: _written_back(local, CAPACITY), "the write-back", SWEEP_S + SLACK_S)
        # Both local requests still run: Redis must not hand their slots out again.
        extra = rid("back")
        try:
            async with held(url, "l", rid=extra, fail_fast=True):
                admitted.add(extra)
                running = worker_load(local.worker)["vllm:num_requests_running"]
                assert running <= CAPACITY, f"{running} running of {CAPACITY}"
        except Refused as refused:
            assert refused.status == 429, refused
        assert extra not in admitted
    await _assert_records(local, admitted)
    left: list[str] = []

    async def clean() -> bool:
        left[:] = await leftovers(local.url, ("l",))
        return not left

    await until(clean, f"Redis to hold nothing ({left})", LEASE_TTL_S + SLACK_S)


async def _assert_records(local: Local, admitted: set[str]) -> None:
    """One record per admission, each with the tokens its lease reserved."""
    found: dict[str, list[dict[bytes, bytes]]] = {}

    async def complete() -> bool:
        found.clear()
        async with redis_of(local) as client:
            for _, fields in cast(StreamEntries, await client.xrange("usage")):
                request = fields[b"request_id"].decode()
                if request.startswith(f"faults-{RUN}-back-"):
                    found.setdefault(request, []).append(fields)
        return set(found) >= admitted

    await until(complete, "the usage records", SWEEP_S + SLACK_S)
    assert {r: len(f) for r, f in found.items()} == dict.fromkeys(admitted, 1)
    assert all(int(f[0][b"reserved_tokens"]) > 0 for f in found.values()), found
