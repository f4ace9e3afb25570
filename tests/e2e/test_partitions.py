"""One model split over partitions (`partitions: 4`) seen from outside: two gateway replicas,
32 simulated workers in one process (`gateway sim --endpoints 32`), the official openai SDK,
on the run's Redis and on its 3-master Redis Cluster. More requests at once than slots: every
one is served, no worker ever runs more than its slot (its own counters), each admission has
one usage record, nothing is left in Redis, and on the Cluster every master serves a share.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from routing.admission.partitions import partition_names, split
from tests.conftest import REDIS_URL
from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.e2e.test_usage import export, wait_for
from tests.redis_cluster import RedisCluster

KEY = "sk-part-acme"
ACCOUNT = "part-acme"
# Enough endpoints that the hash leaves no partition empty (4 x (3/4)^32: 4e-4).
N, K = 32, 4
REQUESTS, AT_ONCE = 96, 48


@dataclass
class Parted:
    replicas: list[procs.Proc]
    sims: procs.Proc
    base: int
    config: Path
    redis_url: str
    cluster: RedisCluster | None


def sim_fleet(tmp: Path, n: int, *extra: str) -> tuple[procs.Proc, int]:
    """`gateway sim --endpoints n` on n consecutive ports; another range if one is taken."""
    for _ in range(10):
        base = random.randrange(20_000, 60_000 - n)
        args = ["sim", "--port", str(base), "--endpoints", str(n), "--models", "m1", *extra]
        try:
            return procs.Proc(args, base, "/health", tmp / f"sims-{base}.log").start(), base
        except RuntimeError:  # a port of the range was taken: it exited
            continue
    raise RuntimeError("no free range of ports for the simulated workers")


def config_text(redis_url: str, base: int) -> str:
    endpoints = "".join(
        f'      - {{url: "http://127.0.0.1:{base + i}", max_concurrency: 1, model: m1}}\n'
        for i in range(N)
    )
    return f"""
redis: {{url: "{redis_url}", lease_ttl_s: 5}}
tiers:
  default: {{queue_timeout_s: 30}}
keys:
  - {{sha256: "{digest(KEY)}", account: {ACCOUNT}}}
models:
  wide:
    partitions: {K}
    max_queue: 100
    endpoints:
{endpoints}"""


@pytest.fixture(scope="module", params=["single", "cluster"])
def parted(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Parted]:
    cluster: RedisCluster | None = None
    redis_url = REDIS_URL
    if request.param == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        redis_url = cluster.url
    tmp = tmp_path_factory.mktemp("parted")
    sims, base = sim_fleet(tmp, N, "--max-seqs", "1", "--ttft-ms", "20", "--itl-ms", "5",
                           "--tokens", "4")  # fmt: skip
    config = tmp / "gateway.yaml"
    config.write_text(config_text(redis_url, base))
    replicas: list[procs.Proc] = []
    try:
        for _ in range(2):
            replicas.append(procs.gateway(tmp, config.read_text()))
        yield Parted(replicas, sims, base, config, redis_url, cluster)
    finally:
        for proc in [*replicas, sims]:
            proc.stop()
        if cluster is not None:
            cluster.flush()


def windows(parted: Parted) -> list[dict[str, Any]]:
    """Each worker's own counters since the last read."""
    return [
        httpx.get(f"http://127.0.0.1:{parted.base + i}/sim/peak", timeout=5).json()
        for i in range(N)
    ]


def leftovers(parted: Parted) -> dict[str, int]:
    """What the partitions' keys still hold (leases, waiters)."""
    found: dict[str, int] = {}
    for part in partition_names("wide", K):
        tag = "gw:v2:{" + part + "}:"
        if parted.cluster is not None:
            node = parted.cluster.node_of("{" + part + "}")
            client = parted.cluster.client(node)
        else:
            client = redis.Redis.from_url(parted.redis_url)
        with client:
            found[part] = int(client.zcard(tag + "leases")) + int(client.zcard(tag + "queue"))
    return found


async def load(parted: Parted) -> list[str]:
    clients = [
        openai.AsyncOpenAI(base_url=r.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        for r in parted.replicas
    ]
    gate = asyncio.Semaphore(AT_ONCE)

    async def one(i: int) -> str:
        async with gate:
            got = await clients[i % 2].completions.with_raw_response.create(
                model="wide", prompt="hello", max_tokens=4
            )
            return got.headers["x-request-id"]

    try:
        return await asyncio.gather(*(one(i) for i in range(REQUESTS)))
    finally:
        for client in clients:
            await client.close()


def test_more_requests_than_slots_are_all_served_within_every_workers_slot(
    parted: Parted,
) -> None:
    windows(parted)  # a new window
    rids = asyncio.run(load(parted))
    seen = windows(parted)
    assert all(w["peak_inflight"] <= 1 and w["peak_waiting"] == 0 for w in seen), seen
    served = [len(w["spans"]) + w["spans_dropped"] for w in seen]
    assert sum(served) == REQUESTS
    wait_for(lambda: sum(leftovers(parted).values()) == 0, "the partitions to be empty")

    def recorded() -> bool:
        mine = [r for r in export(parted.config) if r["request_id"] in set(rids)]
        return len(mine) == REQUESTS

    wait_for(recorded, "one usage record per request")
    records = [r for r in export(parted.config) if r["request_id"] in set(rids)]
    assert len({r["request_id"] for r in records}) == REQUESTS
    assert {r["served_model"] for r in records} == {"wide"}
    if parted.cluster is not None:
        # The partitions' masters: every master of the three serves a share of the model.
        urls = [f"http://127.0.0.1:{parted.base + i}" for i in range(N)]
        masters: dict[int, int] = {}
        for part, mine in zip(partition_names("wide", K), split(urls, K, str), strict=True):
            node = parted.cluster.node_of("{" + part + "}").port
            masters[node] = masters.get(node, 0) + sum(served[urls.index(u)] for u in mine)
        assert len(masters) == 3 and all(masters.values()), masters


def faults(parted: Parted, fault: str | None) -> None:
    for i in range(N):
        url = f"http://127.0.0.1:{parted.base + i}/sim/fault"
        assert httpx.post(url, json={"fault": fault}, timeout=5).status_code == 200


def test_a_replica_killed_holding_every_partition_leaves_nothing_held(
    parted: Parted, tmp_path: Path
) -> None:
    """A third replica takes every slot of all four partitions with requests the workers
    never answer, and is killed with -9: its leases expire, the sweeps of the others
    reclaim them, and their own requests, queued meanwhile, are all served."""
    doomed = procs.gateway(tmp_path, parted.config.read_text())
    faults(parted, "hang")
    body = {"model": "wide", "prompt": "hold", "max_tokens": 4}
    headers = {"Authorization": f"Bearer {KEY}"}
    hung = [httpx.AsyncClient(base_url=doomed.url, headers=headers, timeout=30) for _ in range(N)]

    async def scenario() -> list[str]:
        tasks = [asyncio.create_task(c.post("/v1/completions", json=body)) for c in hung]
        try:
            held = lambda: sum(leftovers(parted).values()) == N  # noqa: E731
            await asyncio.to_thread(wait_for, held, "every slot held")
            assert doomed.popen is not None
            doomed.popen.kill()
            doomed.popen.wait(timeout=10)
            faults(parted, None)
            return await load(parted)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for client in hung:
                await client.aclose()

    try:
        rids = asyncio.run(scenario())
    finally:
        faults(parted, None)
        doomed.stop()
    assert len(set(rids)) == REQUESTS
    seen = windows(parted)
    assert all(w["peak_inflight"] <= 1 and w["peak_waiting"] == 0 for w in seen), seen
    wait_for(lambda: sum(leftovers(parted).values()) == 0, "the partitions to be empty")
