"""The fleet at rest and at low traffic (bench/fleet.py --only low, issue 41): what 1,000
endpoints cost a replica when little or nothing happens, with the health probes at their
default interval (5 s).

Per N in 1 and 1,000 (the same total capacity, fleet_http.CAPACITY slots, split over the
N), the http part's fleet (one `gateway sim --endpoints N`, two `gateway serve` replicas on
a redis-server): after a warm-up of a request per endpoint,
- idle: no request for IDLE_S seconds; each replica's CPU per second (/proc);
- low traffic: one request at a time (c = 1, the replicas in turn), REQUESTS of them, each
  taking the simulator TTFT_MS; the replicas' CPU per request, probes and sweeps included.
Ratios against N = 1 in the same round; rounds interleave N, medians.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from fleet_http import CAPACITY, REPLICAS, Fleet, drive

IDLE_S = 20.0
REQUESTS = 1500
# Each request's first token after this long (the simulator's): one at a time, about 85 a
# second, so that at 1,000 endpoints each sees a request every dozen seconds or so.
TTFT_MS = 10
SIZES = (1, 1000)


async def one(fleet: Fleet, requests: int, idle_s: float) -> dict[str, Any]:
    await drive(fleet.urls, max(200, fleet.n), 16)  # every endpoint once at least
    await asyncio.sleep(5.5)  # past a probe round: the warm-up's work done
    c0, t0 = fleet.gateway_cpu(), time.monotonic()
    await asyncio.sleep(idle_s)
    c1, t1 = fleet.gateway_cpu(), time.monotonic()
    statuses = await drive(fleet.urls, requests, 1)
    c2, t2 = fleet.gateway_cpu(), time.monotonic()
    ok = statuses.get(200, 0)
    return {
        "endpoints": fleet.n,
        "idle_cpu_ms_per_s_per_replica": round((c1 - c0) / (t1 - t0) / REPLICAS * 1e3, 2),
        "requests": requests,
        "statuses": dict(statuses),
        "requests_per_s": round(ok / (t2 - t1), 1),
        "gateway_cpu_us_per_request": round((c2 - c1) / max(ok, 1) * 1e6, 1),
    }


def run(tmp: Path, redis_url: str, rounds: int, requests: int = REQUESTS,
        idle_s: float = IDLE_S) -> list[dict[str, Any]]:  # fmt: skip
    rows: list[dict[str, Any]] = []
    for _ in range(rounds):
        for n in SIZES:
            fleet = Fleet(tmp, redis_url, n, CAPACITY // n, ttft_ms=TTFT_MS, health_s=None)
            try:
                row = asyncio.run(one(fleet, requests, idle_s))
            finally:
                fleet.stop()
            rows.append(row)
            print(row, flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    fields = ("idle_cpu_ms_per_s_per_replica", "gateway_cpu_us_per_request")
    table = {}
    for n in SIZES:
        mine = [r for r in rows if r["endpoints"] == n]
        table[f"n={n}"] = {f: sorted(r[f] for r in mine)[len(mine) // 2] for f in fields}
    base = table["n=1"]
    ratios = {key: {f: round(v[f] / base[f], 2) for f in fields} for key, v in table.items()}
    return {"medians": table, "ratio_to_n1": ratios}
