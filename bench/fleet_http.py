"""The fleet over HTTP (bench/fleet.py --http): N simulated endpoints in one process
(`gateway sim --endpoints N`), one model over them, M gateway replicas (`gateway serve`) on a
real redis-server, and a load of non-streamed completions from this process.

Per N in 1, 64 and 1,000 (the same total capacity, CAPACITY slots, split over the N): the
Redis CPU (INFO used_cpu) and the gateways' CPU (/proc, every replica) per admitted request,
the load below capacity (an empty queue: the cost of N, not of waiting). Connections to every
endpoint are opened by a warm-up first, so that what is measured is the steady state.

The partition run: a 3-master Redis Cluster of the bench's own, one model on 64 endpoints of
one slot each with `partitions: 4`, and more requests at once than slots (so admission binds):
each master's share of the model's admissions (the requests its partitions' endpoints served,
from the simulators' own counts), each master's EVALSHA calls and CPU, and the check that no
simulator ever ran more than its slot (its own peak) or queued a request.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import harness
import httpx
import redis
from redis.crc import key_slot

from routing.admission.partitions import partition_names, split
from tests.e2e.procs import Proc
from tests.redis_cluster import RedisCluster, start_cluster

KEY = "sk-bench-fleet"
MODEL = "fleet"
CAPACITY = 1000
REPLICAS = 2
CONCURRENCY = 32
SIM = ("--itl-ms", "0", "--tokens", "1")
BODY = {"model": MODEL, "prompt": "x", "max_tokens": 1}


def contiguous_ports(n: int, tries: int = 50) -> int:
    """The first of `n` consecutive free loopback ports (checked by binding each)."""
    for _ in range(tries):
        base = random.randrange(20_000, 60_000 - n)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def account_key(i: int) -> str:
    """The key of the bench's account `i` (bench/fleet_queue.py: one account per key)."""
    return f"{KEY}-{i}"


def config(
    redis_url: str,
    base: int,
    n: int,
    size: int,
    partitions: int = 1,
    budget: int | None = None,
    accounts: int = 0,
    health_s: float | None = 300,
) -> str:
    """`budget`: each endpoint's token budget (`max_tokens_in_flight`), none by default;
    `accounts`: as many more keys (`account_key`), each its own account; `health_s`: the
    probes' interval (None: the default)."""
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    keys = "".join(
        f'  - {{sha256: "{hashlib.sha256(account_key(i).encode()).hexdigest()}", '
        f"account: a{i}, max_concurrency: 100000}}\n"
        for i in range(accounts)
    )
    tokens = f", max_tokens_in_flight: {budget}" if budget else ""
    endpoints = "".join(
        f'      - {{url: "http://127.0.0.1:{base + i}", max_concurrency: {size}, model: m'
        f"{tokens}}}\n"
        for i in range(n)
    )
    return f"""
redis: {{url: "{redis_url}", lease_ttl_s: 30}}
{"" if health_s is None else f"health: {{interval_s: {health_s}}}"}
keys:
  - {{sha256: "{digest}", account: bench, max_concurrency: 100000}}
{keys}tiers: {{default: {{queue_timeout_s: 300}}}}
models:
  {MODEL}:
    partitions: {partitions}
    max_queue: 100000
    endpoints:
{endpoints}"""


async def drive(urls: Sequence[str], total: int, concurrency: int) -> Counter[int]:
    """`total` completions over the gateways at `urls`, `concurrency` at once: the statuses."""
    statuses: Counter[int] = Counter()
    left = iter(range(total))
    headers = {"Authorization": f"Bearer {KEY}"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout) as s:

        async def worker(url: str) -> None:
            for _ in left:
                async with s.post(url + "/v1/completions", json=BODY) as answer:
                    await answer.read()
                    statuses[answer.status] += 1

        await asyncio.gather(*(worker(urls[i % len(urls)]) for i in range(concurrency)))
    return statuses


async def sim_counts(base: int, n: int) -> list[dict[str, Any]]:
    """Each simulator's own window since the last read (`/sim/peak`; a read starts another)."""
    async with httpx.AsyncClient(timeout=30) as http:
        sem = asyncio.Semaphore(64)

        async def one(port: int) -> dict[str, Any]:
            async with sem:
                got: dict[str, Any] = (await http.get(f"http://127.0.0.1:{port}/sim/peak")).json()
                return got

        return await asyncio.gather(*(one(base + i) for i in range(n)))


def served(window: dict[str, Any]) -> int:
    return len(window["spans"]) + int(window["spans_dropped"])


class Fleet:
    """One sim process of N endpoints and M gateways on `redis_url`."""

    def __init__(
        self,
        tmp: Path,
        redis_url: str,
        n: int,
        size: int,
        partitions: int = 1,
        budget: int | None = None,
        accounts: int = 0,
        ttft_ms: int = 0,
        health_s: float | None = 300,
    ) -> None:
        self.n, self.size = n, size
        self.base = contiguous_ports(n)
        args = ["sim", "--port", str(self.base), "--endpoints", str(n), "--models", "m",
                "--max-seqs", str(size), *SIM, "--ttft-ms", str(ttft_ms)]  # fmt: skip
        self.sim = Proc(args, self.base, "/health", tmp / f"sim-{self.base}.log").start()
        text = config(redis_url, self.base, n, size, partitions, budget, accounts, health_s)
        self.gateways: list[Proc] = []
        try:
            for _ in range(REPLICAS):
                port = harness.free_port()
                path = tmp / f"gateway-{port}.yaml"
                path.write_text(text)
                args = ["serve", "--config", str(path), "--port", str(port), "--host", "127.0.0.1"]
                log = tmp / f"gateway-{port}.log"
                self.gateways.append(Proc(args, port, "/healthz", log).start())
        except BaseException:
            self.stop()
            raise

    @property
    def urls(self) -> list[str]:
        return [g.url for g in self.gateways]

    def gateway_cpu(self) -> float:
        return sum(harness.Proc(g.popen, g.port).cpu_seconds() for g in self.gateways if g.popen)

    def stop(self) -> None:
        for proc in [*self.gateways, self.sim]:
            proc.stop()


async def measured_run(
    fleet: Fleet, requests: int, concurrency: int, redis_cpu: Callable[[], float]
) -> dict[str, Any]:
    warm = max(500, 3 * fleet.n * REPLICAS)
    await drive(fleet.urls, warm, concurrency)
    await sim_counts(fleet.base, fleet.n)  # a new window
    r0, g0 = redis_cpu(), fleet.gateway_cpu()
    statuses = await drive(fleet.urls, requests, concurrency)
    r1, g1 = redis_cpu(), fleet.gateway_cpu()
    windows = await sim_counts(fleet.base, fleet.n)
    ok = statuses.get(200, 0)
    peak = max(w["peak_inflight"] for w in windows)
    waiting = max(w["peak_waiting"] for w in windows)
    return {
        "endpoints": fleet.n,
        "requests": requests,
        "statuses": dict(statuses),
        "redis_cpu_us_per_request": round((r1 - r0) / max(ok, 1) * 1e6, 1),
        "gateway_cpu_us_per_request": round((g1 - g0) / max(ok, 1) * 1e6, 1),
        "peak_inflight_of_any_endpoint": peak,
        "endpoint_size": fleet.size,
        "capacity_held": peak <= fleet.size and waiting == 0,
        "windows": windows,
    }


def redis_cpu_of(url: str) -> Callable[[], float]:
    client = redis.Redis.from_url(url)

    def read() -> float:
        cpu = client.info("cpu")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    return read


def single(tmp: Path, redis_url: str, requests: int, rounds: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cpu = redis_cpu_of(redis_url)
    for _ in range(rounds):
        for n in (1, 64, 1000):
            fleet = Fleet(tmp, redis_url, n, CAPACITY // n)
            try:
                row = asyncio.run(measured_run(fleet, requests, CONCURRENCY, cpu))
            finally:
                fleet.stop()
            del row["windows"]
            rows.append(row)
            print({k: v for k, v in row.items()}, flush=True)
    return rows


def partitioned(tmp: Path, requests: int) -> dict[str, Any]:
    """`partitions: 4` on a 3-master Cluster, 64 endpoints of one slot, 96 requests at once."""
    cluster = start_cluster(tmp / "cluster")
    try:
        return _partitioned(tmp, cluster, requests)
    finally:
        cluster.stop()


def _partitioned(tmp: Path, cluster: RedisCluster, requests: int) -> dict[str, Any]:
    n, k = 64, 4
    masters = {node.port: cluster.client(node) for node in cluster.nodes}

    def readings() -> dict[int, tuple[float, int]]:
        found = {}
        for port, client in masters.items():
            cpu = client.info("cpu")
            stats = client.info("commandstats")  # script calls: by FCALL, or by EVALSHA
            calls = sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("fcall", "evalsha"))
            found[port] = (float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), int(calls))
        return found

    fleet = Fleet(tmp, cluster.url, n, 1, partitions=k)
    try:
        total_cpu = lambda: sum(c for c, _ in readings().values())  # noqa: E731
        before = readings()
        row = asyncio.run(measured_run(fleet, requests, 96, total_cpu))
        after = readings()
    finally:
        fleet.stop()
    for client in masters.values():
        client.close()
    parts = partition_names(MODEL, k)
    urls = [f"http://127.0.0.1:{port}" for port in range(fleet.base, fleet.base + n)]
    with cluster.client(cluster.nodes[0]) as client:
        ranges = [(int(a), int(b), int(node[1])) for a, b, node, *_ in client.cluster("SLOTS")]
    master_of_url = {
        url: _master(ranges, part)
        for part, mine in zip(parts, split(urls, k, str), strict=True)
        for url in mine
    }
    share: Counter[int] = Counter()
    for url, window in zip(urls, row.pop("windows"), strict=True):
        share[master_of_url[url]] += served(window)
    total = sum(share.values()) or 1
    return {
        **row,
        "partitions": k,
        "masters": {
            str(port): {
                "share_of_admissions": round(share[port] / total, 3),
                "partitions": sum(1 for p in parts if _master(ranges, p) == port),
                "script_calls": after[port][1] - before[port][1],
                "cpu_s": round(after[port][0] - before[port][0], 3),
            }
            for port in masters
        },
    }


def _master(ranges: list[tuple[int, int, int]], part: str) -> int:
    slot = key_slot(part.encode())
    return next(p for a, b, p in ranges if a <= slot <= b)
