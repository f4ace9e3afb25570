"""What token budgets cost (issue 28): CPU per request with every endpoint's
`max_tokens_in_flight` set against the same fleet without, over HTTP.

Run: .venv/bin/python bench/budgets.py [--requests N] [--rounds R] [--out FILE] (part of
`make bench`). Results: bench/results/budgets-<date>.json; figures in bench/README.md.

Two `gateway serve` replicas on a redis-server of the bench's own, `gateway sim --endpoints 8`
(eight workers of 64 slots in one process, instant answers), non-streamed completions 32 at
once from this process (below capacity: no queue, the cost of admission itself). Budgets on:
each endpoint holds 1,000,000 tokens (never binding: what is measured is their bookkeeping,
the reservation in the lease id and `ep_tok` kept at every grant and release). The rounds
alternate off and on; medians. Gateway CPU is both replicas' (/proc), Redis CPU is INFO
used_cpu, each per request served.

The same at the scripts alone (`--only scripts`; bench/fleet.py's cycles, no HTTP): a model
of 64 endpoints, an acquire granted at once and its release, and admissions through a
queue of 10; every lease reserving 1,000 tokens of budgets of 1,000,000 when on. Redis's
own time in the scripts (INFO commandstats usec) is far steadier than CPU over HTTP on a
shared VM, so it is the figure the ratio is read from.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

import fleet  # noqa: E402
import fleet_http  # noqa: E402
import harness  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from rediskit import measured  # noqa: E402

from routing.admission.slots import make_lease_id  # noqa: E402
from routing.store.resp import RespClient  # noqa: E402
from routing.store.scripts import Scripts  # noqa: E402

ENDPOINTS, SIZE = 8, 64
BUDGET = 1_000_000
SCRIPT_ENDPOINTS, TOKENS, SCRIPT_CYCLES = 64, 1000, 4000


class Budgeted(fleet.Model):
    """bench/fleet.py's model, its endpoints with budgets and its leases reserving tokens."""

    def __init__(self, store: RespClient, scripts: Scripts, name: str, budget: bool) -> None:
        super().__init__(store, scripts, SCRIPT_ENDPOINTS, name)
        self.tokens = TOKENS if budget else 0
        if budget:
            size = fleet.CAPACITY // SCRIPT_ENDPOINTS
            self.slots.set_endpoints([(u, size, 0.0, BUDGET) for u in self.slots.urls])

    def new_id(self, account: str) -> str:
        self._next += 1
        return make_lease_id(f"{fleet.TAG}-{self._next}", 1, account, self.tokens)


async def scripts_one(url: str, info: aioredis.Redis, queue: str, budget: bool) -> dict[str, Any]:
    store, scripts = RespClient(url), Scripts()
    await scripts.load(store)
    model = Budgeted(store, scripts, f"{fleet.TAG}-tok-{queue}-{budget}", budget)
    wakes = info.pubsub()
    await wakes.subscribe(model.slots.channel)
    cycles = SCRIPT_CYCLES
    try:
        if queue == "empty":
            await model.setup(model.capacity // 2, 0, accounts=False)
            delta = await measured(info, model.direct_cycles(cycles))
        else:
            await model.setup(model.capacity, 10, accounts=False)
            delta = await measured(info, model.queued_cycles(cycles, False, wakes))
    finally:
        await wakes.aclose()
        await model.clear(info)
        await store.aclose()
    return {
        "queue": queue,
        "budgets": budget,
        "redis_cmd_us_per_admission": round(sum(delta.usec.values()) / cycles, 2),
        "redis_cpu_us_per_admission": round(delta.cpu_s / cycles * 1e6, 2),
    }


async def scripts_rounds(url: str, rounds: int) -> list[dict[str, Any]]:
    info = aioredis.Redis.from_url(url)
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(rounds):
            for queue in ("empty", "short"):
                for budget in (False, True):
                    rows.append(await scripts_one(url, info, queue, budget))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        await info.aclose()
    return rows


def scripts_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for queue in ("empty", "short"):
        med = {
            on: {
                f: statistics.median(
                    r[f] for r in rows if r["queue"] == queue and r["budgets"] == on
                )
                for f in ("redis_cmd_us_per_admission", "redis_cpu_us_per_admission")
            }
            for on in (False, True)
        }
        out[queue] = {
            "off": med[False],
            "on": med[True],
            "on_over_off": {f: round(med[True][f] / med[False][f], 3) for f in med[False]},
        }
    return out


def one(tmp: Path, url: str, requests: int, budget: int | None) -> dict[str, Any]:
    fleet = fleet_http.Fleet(tmp, url, ENDPOINTS, SIZE, budget=budget)
    try:
        row = asyncio.run(
            fleet_http.measured_run(
                fleet, requests, fleet_http.CONCURRENCY, fleet_http.redis_cpu_of(url)
            )
        )
    finally:
        fleet.stop()
    del row["windows"]
    row["budgets"] = budget is not None
    row["total_cpu_us_per_request"] = round(
        row["redis_cpu_us_per_request"] + row["gateway_cpu_us_per_request"], 1
    )
    return row


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    fields = ("gateway_cpu_us_per_request", "redis_cpu_us_per_request", "total_cpu_us_per_request")
    medians = {
        state: {f: statistics.median(r[f] for r in rows if r["budgets"] == on) for f in fields}
        for state, on in (("off", False), ("on", True))
    }
    ratio = {f: round(medians["on"][f] / medians["off"][f], 3) for f in fields}
    held = all(r["capacity_held"] and r["statuses"] == {200: r["requests"]} for r in rows)
    return {"medians": medians, "on_over_off": ratio, "all_served_capacity_held": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["http", "scripts"], default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, harness.bench_redis(Path(tmp)) as url:
        if args.only != "http":
            script_rows = asyncio.run(scripts_rounds(url, args.rounds))
            result["scripts"] = {"rows": script_rows, **scripts_summary(script_rows)}
        if args.only != "scripts":
            for _ in range(args.rounds):
                for budget in (None, BUDGET):
                    rows.append(one(Path(tmp), url, args.requests, budget))
                    print(json.dumps(rows[-1]), flush=True)
            result.update({"rows": rows, **summary(rows)})
    print(json.dumps(_without_rows(result), indent=1))
    out = Path(args.out) if args.out else harness.results_path("budgets-")
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"results: {out}")


def _without_rows(result: dict[str, Any]) -> dict[str, Any]:
    return {
        k: _without_rows(v) if isinstance(v, dict) else v for k, v in result.items() if k != "rows"
    }


if __name__ == "__main__":
    main()
