"""Admission alone: Redis round trips per request and the latency of a fail-fast 429.

Run: .venv/bin/python bench/admission.py [--requests N] [--quick] [--redis URL]

Redis: a redis-server of the benchmark's own on a free port, unless --redis or REDIS_URL
names one (used as it is, never flushed).

Everything is measured in one run on this machine, against the real Redis:
- a bare Redis PING (the floor of any decision that asks Redis),
- Admission.admit + release in process (round trips counted at the socket),
- a fail-fast 429 through a real gateway process over HTTP, next to GET /healthz on the same
  gateway (the HTTP floor), with the model's slots held by open streams.
Results go to bench/results/admission-<date>.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

import harness  # noqa: E402

from gateway.runtime.settings import parse_config  # noqa: E402
from routing.admission.admit import Admission  # noqa: E402
from routing.admission.plan import plan_candidates  # noqa: E402
from routing.errors import Limited  # noqa: E402
from routing.registry import Registry  # noqa: E402
from routing.store import resp  # noqa: E402
from routing.store.resp import RespClient  # noqa: E402
from tests.e2e import procs  # noqa: E402

KEY = "sk-bench"


class RoundTrips:
    """Counts socket writes to Redis: redis-py's sends, and the gateway's own client's
    flushes (one per loop tick; requests run one at a time here, so one per round trip)."""

    def __init__(self) -> None:
        self.count = 0
        self._original = Connection.send_packed_command
        self._flush = resp._Protocol._flush

    def __enter__(self) -> RoundTrips:
        counter = self

        async def counted(conn: Connection, command: Any, check_health: bool = True) -> None:
            counter.count += 1
            await counter._original(conn, command, check_health)

        def flushed(protocol: Any) -> None:
            counter.count += 1
            counter._flush(protocol)

        Connection.send_packed_command = counted  # type: ignore[method-assign]
        resp._Protocol._flush = flushed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Connection.send_packed_command = self._original  # type: ignore[method-assign]
        resp._Protocol._flush = self._flush  # type: ignore[method-assign]


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50_ms": round(q[49], 3), "p99_ms": round(q[98], 3), "n": len(ms)}


async def timed(n: int, call: Callable[[], Awaitable[Any]]) -> list[float]:
    for _ in range(min(50, n)):  # warm-up
        await call()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - start)
    return samples


def config_text(redis_url: str, worker: str = "http://127.0.0.1:9") -> str:
    digest = __import__("hashlib").sha256(KEY.encode()).hexdigest()
    return f"""
redis: {{url: "{redis_url}", lease_ttl_s: 30}}
models:
  bench: {{endpoints: [{{url: "{worker}", max_concurrency: 2, model: m1}}]}}
keys: [{{sha256: "{digest}", account: bench}}]
"""


async def in_process(redis_url: str, n: int) -> dict[str, Any]:
    client = aioredis.Redis.from_url(redis_url)
    config = parse_config(config_text(redis_url), "bench.yaml")
    registry = Registry(config.models)
    # The store the gateway itself uses for redis:// URLs (routing/store/resp.py).
    store = RespClient(redis_url)
    admission = Admission(store, registry, config.tiers, lease_ttl_s=30, on_outage="reject")
    await admission.start()
    plan = plan_candidates("bench", None, fail_fast=True, registry=registry, allowed=None)

    async def admit_release() -> None:
        admitted = await admission.admit(plan, "bench", 1000)
        await admission.release(admitted.lease)

    ping = await timed(n, client.ping)
    with RoundTrips() as trips:
        pairs = await timed(n, admit_release)
    per_request = trips.count / (n + min(50, n))
    held = [await admission.admit(plan, "bench", 1000) for _ in range(2)]

    async def rejected() -> None:
        try:
            await admission.admit(plan, "bench", 1000)
        except Limited:
            return
        raise AssertionError("admitted past capacity")

    with RoundTrips() as trips:
        busy = await timed(n, rejected)
    per_429 = trips.count / (n + min(50, n))
    for admitted in held:
        await admission.release(admitted.lease)
    await store.aclose()
    await client.aclose()
    return {
        "redis_ping": percentiles(ping),
        "admit_release": {**percentiles(pairs), "round_trips": round(per_request, 2)},
        "fail_fast_429_in_process": {**percentiles(busy), "round_trips": round(per_429, 2)},
    }


async def over_http(redis_url: str, n: int, tmp: Path) -> dict[str, Any]:
    sim = procs.sim(
        tmp, "--max-seqs", "2", "--ttft-ms", "0", "--itl-ms", "50", "--tokens", "100000"
    )
    gateway = procs.gateway(tmp, config_text(redis_url, sim.url))
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "bench", "prompt": "x", "max_tokens": 1, "fail_fast": True}
    try:
        async with httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=30) as http:
            streams = []
            for _ in range(2):  # hold both slots
                request = http.build_request(
                    "POST", "/v1/completions", json={**body, "stream": True, "max_tokens": 100000}
                )
                response = await http.send(request, stream=True)
                streams.append((response, response.aiter_bytes()))
                await anext(streams[-1][1])

            async def health() -> None:
                (await http.get("/healthz")).raise_for_status()

            async def busy() -> None:
                if (await http.post("/v1/completions", json=body)).status_code != 429:
                    raise AssertionError("expected 429")

            floor = await timed(n, health)
            rejected = await timed(n, busy)
            for response, _ in streams:
                await response.aclose()
    finally:
        gateway.stop()
        sim.stop()
    return {"http_healthz": percentiles(floor), "fail_fast_429_http": percentiles(rejected)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run (100 requests) that writes no results file",
    )
    parser.add_argument(
        "--redis",
        help="a Redis to use as it is (default: REDIS_URL, else "
        "a redis-server of the benchmark's own)",
    )
    parser.add_argument(
        "--out", type=Path, help="results file (default bench/results/admission-<date>.json)"
    )
    args = parser.parse_args()
    n = 100 if args.quick else args.requests
    tmp = Path(tempfile.mkdtemp(prefix="bench-admission-"))
    try:
        with harness.bench_redis(tmp, args.redis) as redis_url:
            results = asyncio.run(measure(redis_url, n, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(results, args.out or (None if args.quick else harness.results_path("admission-")))


async def measure(redis_url: str, n: int, tmp: Path) -> dict[str, Any]:
    results = await in_process(redis_url, n)
    results.update(await over_http(redis_url, n // 2, tmp))
    return results


def report(results: dict[str, Any], out: Path | None) -> None:
    ping = results["redis_ping"]["p50_ms"]
    results["machine"] = {"cpus": __import__("os").cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform()}  # fmt: skip
    print(f"{'measure':34} {'p50 ms':>8} {'p99 ms':>8} {'x PING p50':>10} {'RTs':>5}")
    for name, row in results.items():
        if name == "machine":
            continue
        ratio = row["p50_ms"] / ping if ping else float("nan")
        trips = row.get("round_trips", "")
        print(f"{name:34} {row['p50_ms']:8.3f} {row['p99_ms']:8.3f} {ratio:10.1f} {trips!s:>5}")
    if out is not None:
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"written: {out}")


if __name__ == "__main__":
    main()
