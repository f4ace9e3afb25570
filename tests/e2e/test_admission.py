"""Fleet-wide admission seen from outside: real Redis, two gateway replicas, simulated workers.

Long requests are streams the test holds open and closes itself, so "in flight" is under
the test's control and nothing depends on timing.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from routing.store.connect import connect
from tests.conftest import REDIS_URL
from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.redis_cluster import RedisCluster

KEY = "sk-adm-acme"
KEY_ONE = "sk-adm-one"  # an account allowed one request in flight
LEASE_TTL_S = 2


@dataclass
class Admissions:
    replicas: list[procs.Proc]
    narrow: procs.Proc  # the only worker of cap2: max_seqs 2
    wide: procs.Proc
    config: str
    tmp: Path
    redis_url: str  # the run's Redis, or a node of the run's Redis Cluster


def admission_config(narrow: procs.Proc, wide: procs.Proc, redis_url: str) -> str:
    return f"""
redis: {{url: "{redis_url}", lease_ttl_s: {LEASE_TTL_S}}}
tiers:
  default: {{queue_timeout_s: 20}}
  priority: {{queue_timeout_s: 20}}
  flex: {{queue_timeout_s: 1}}
models:
  cap2:
    tiers: [default, priority, flex]
    max_queue: 100
    endpoints: [{{url: "{narrow.url}", max_concurrency: 2, model: m1}}]
  cap5:
    tiers: [default, flex]
    endpoints: [{{url: "{wide.url}", max_concurrency: 5, model: m1}}]
  free:
    endpoints: [{{url: "{wide.url}", max_concurrency: 4, model: m1}}]
  q1:
    max_queue: 1
    endpoints: [{{url: "{wide.url}", max_concurrency: 1, model: m1}}]
keys:
  - {{sha256: "{digest(KEY)}", account: adm-acme}}
  - {{sha256: "{digest(KEY_ONE)}", account: adm-one, max_concurrency: 1}}
"""


# Every test runs on a single Redis and on a 3-master Redis Cluster (the gateway is given
# one node's address and finds the others), the models and accounts spread over its nodes.
@pytest.fixture(scope="module", params=["single", "cluster"])
def fleet(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Admissions]:
    redis_url = REDIS_URL
    if request.param == "cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        nodes = {n: cluster.node_of("{" + n + "}").port for n in ("cap2", "cap5", "q1")}
        assert len(set(nodes.values())) == 3, nodes
        assert cluster.node_of("{adm-one}").port != nodes["cap2"]
        assert cluster.node_of("{adm-acme}").port != nodes["cap5"]
        redis_url = cluster.url
    tmp = tmp_path_factory.mktemp("admission")
    started: list[procs.Proc] = []
    try:
        # Long answers (a 4000-token stream lasts ~40 s) that tests cut short themselves.
        narrow = procs.sim(
            tmp, "--max-seqs", "2", "--ttft-ms", "0", "--itl-ms", "10", "--tokens", "4000"
        )
        started.append(narrow)
        wide = procs.sim(
            tmp, "--max-seqs", "16", "--ttft-ms", "0", "--itl-ms", "10", "--tokens", "4000"
        )
        started.append(wide)
        config = admission_config(narrow, wide, redis_url)
        replicas = [procs.gateway(tmp, config) for _ in range(2)]
        started += replicas
        yield Admissions(replicas, narrow, wide, config, tmp, redis_url)
    finally:
        for proc in started:
            proc.stop()


def body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "x", "max_tokens": 2, **extra}


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@asynccontextmanager
async def held(url: str, model: str, key: str = KEY, **extra: Any) -> AsyncIterator[None]:
    """A long stream, admitted and flowing until the block ends (then the slot frees)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        payload = {"model": model, "prompt": "x", "stream": True, **extra}
        async with client.stream("POST", "/v1/completions", json=payload, headers=auth(key)) as r:
            assert r.status_code == 200
            chunks = r.aiter_bytes()  # keep a reference: a collected iterator closes the stream
            await anext(chunks)
            yield


async def post(url: str, payload: dict[str, Any], key: str = KEY) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await client.post("/v1/completions", json=payload, headers=auth(key))


async def queued(redis_url: str, model: str) -> int:
    client = connect(redis_url, command_timeout_s=5.0)
    try:
        return int(await client.zcard("gw:v2:{" + model + "}:queue"))
    finally:
        await client.aclose()


async def until(check: Any, what: str, limit_s: float = 10.0) -> None:
    """Wait for a condition of other processes, bounded; there is no event to wait on."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_fail_fast_is_429_and_a_waiter_is_served_when_a_slot_frees(fleet: Admissions) -> None:
    a, b = (r.url for r in fleet.replicas)
    async with held(a, "cap2"):
        async with held(b, "cap2"):
            busy = await post(a, body("cap2", fail_fast=True))
            assert busy.status_code == 429
            assert busy.json()["error"]["code"] == "model_busy"
            assert busy.json()["error"]["type"] == "rate_limit_error"
            assert int(busy.headers["retry-after"]) >= 1
            waiter = asyncio.create_task(post(b, body("cap2")))
            await until(lambda: _queued_is(fleet.redis_url, ("cap2", 1)), "the waiter to queue")
            assert not waiter.done()
            # The fleet-wide gauges come from Redis: any replica shows them after its sweep.
            await until(lambda: _gauges_show(a, inflight=2, queued=1), "gauges to show it")
        served = await asyncio.wait_for(waiter, 20)
        assert served.status_code == 200
        assert served.json()["model"] == "cap2"


async def _gauges_show(url: str, *, inflight: int, queued: int) -> bool:
    async with httpx.AsyncClient() as client:
        text = (await client.get(url + "/metrics")).text
    return (
        f'gateway_inflight{{model="cap2"}} {inflight:.1f}' in text
        and f'gateway_queue_depth{{model="cap2",tier="default"}} {queued:.1f}' in text
    )


async def _queued_is(redis_url: str, expect: tuple[str, int]) -> bool:
    return await queued(redis_url, expect[0]) == expect[1]


async def test_fallback_to_a_free_model(fleet: Admissions) -> None:
    a, b = (r.url for r in fleet.replicas)
    async with held(a, "cap2"), held(b, "cap2"):
        resp = await post(a, body("cap2", models=["cap2", "free"]))
        assert resp.status_code == 200
        assert resp.json()["model"] == "free"
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(a + "/metrics")).text
        assert 'gateway_fallbacks_total{from_model="cap2",to_model="free"}' in metrics


async def test_priority_waiter_goes_before_an_earlier_default_one(fleet: Admissions) -> None:
    a, b = (r.url for r in fleet.replicas)
    async with held(a, "cap2"):
        async with held(b, "cap2"):
            default = asyncio.create_task(post(a, body("cap2")))
            await until(lambda: _queued_is(fleet.redis_url, ("cap2", 1)), "the default waiter")
            priority = asyncio.create_task(post(b, body("cap2", service_tier="priority")))
            await until(lambda: _queued_is(fleet.redis_url, ("cap2", 2)), "the priority waiter")
        # One slot freed: it goes to the priority waiter, the default one still waits.
        served = await asyncio.wait_for(priority, 20)
        assert served.status_code == 200 and served.json()["service_tier"] == "priority"
        assert not default.done()
    assert (await asyncio.wait_for(default, 20)).status_code == 200


async def test_flex_stays_below_its_ceiling(fleet: Admissions) -> None:
    a, b = (r.url for r in fleet.replicas)
    # cap5 with flex at 0.8: flex may take a slot only while fewer than 4 are in flight.
    async with held(a, "cap5"), held(b, "cap5"), held(a, "cap5"), held(b, "cap5"):
        flex = await post(a, body("cap5", service_tier="flex", fail_fast=True))
        assert flex.status_code == 429
        assert flex.json()["error"]["code"] == "flex_no_capacity"
        default = await post(b, body("cap5", fail_fast=True))
        assert default.status_code == 200


async def test_queue_full_and_queue_timeout(fleet: Admissions) -> None:
    a, b = (r.url for r in fleet.replicas)
    async with held(a, "q1"):
        waiter = asyncio.create_task(post(b, body("q1")))
        await until(lambda: _queued_is(fleet.redis_url, ("q1", 1)), "the first waiter")
        full = await post(a, body("q1"))
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        waiter.cancel()
    async with held(a, "cap2"), held(b, "cap2"):
        # flex waits at most 1 s in this config
        late = await post(a, body("cap2", service_tier="flex"))
        assert late.status_code == 429
        assert late.json()["error"]["code"] == "queue_timeout"
        assert int(late.headers["retry-after"]) >= 1


async def test_account_limit_holds_across_replicas(fleet: Admissions) -> None:
    a, b = (r.url for r in fleet.replicas)
    async with held(a, "free", key=KEY_ONE):
        over = await post(b, body("free"), key=KEY_ONE)
        assert over.status_code == 429
        assert over.json()["error"]["code"] == "concurrency_limit"
    await until(lambda: _ok(b, KEY_ONE), "the account's slot to come back")


async def _ok(url: str, key: str) -> bool:
    return (await post(url, body("free", fail_fast=True), key=key)).status_code == 200


async def test_burst_across_two_replicas_never_overloads_the_worker(fleet: Admissions) -> None:
    urls = [r.url for r in fleet.replicas]
    payloads = [body("cap2", max_tokens=3, fail_fast=(i % 3 == 0)) for i in range(20)]
    answers = await asyncio.gather(*(post(urls[i % 2], p) for i, p in enumerate(payloads)))
    assert {a.status_code for a in answers} <= {200, 429}
    assert any(a.status_code == 200 for a in answers)
    peaks = sim_peaks(fleet.narrow)
    assert peaks["running"] <= 2
    assert peaks["waiting"] == 0


async def test_killed_replica_gives_its_slots_back_within_the_lease_ttl(fleet: Admissions) -> None:
    doomed = procs.gateway(fleet.tmp, fleet.config)
    survivor = fleet.replicas[0].url
    try:
        async with held(doomed.url, "cap2"), held(doomed.url, "cap2"):
            busy = await post(survivor, body("cap2", fail_fast=True))
            assert busy.status_code == 429
            doomed.stop(signal.SIGKILL)
            # Bounded by the lease TTL plus the sweep's period and some slack for a busy CI.
            await until(lambda: _cap2_free(survivor), "the slots to return", LEASE_TTL_S + 3)
    except (httpx.RemoteProtocolError, httpx.ReadError):
        pass  # the held streams die with their replica
    finally:
        doomed.stop(signal.SIGKILL)


async def _cap2_free(url: str) -> bool:
    return (await post(url, body("cap2", fail_fast=True))).status_code == 200


def sim_peaks(sim: procs.Proc) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(sim.url + "/metrics").text.splitlines():
        for kind in ("running", "waiting"):
            if line.startswith(f"sim:peak_requests_{kind}"):
                values[kind] = float(line.rsplit(" ", 1)[1])
    return values


def test_no_lease_is_left_and_the_narrow_worker_was_never_overloaded(fleet: Admissions) -> None:
    peaks = sim_peaks(fleet.narrow)
    assert peaks == {"running": 2.0, "waiting": 0.0}
