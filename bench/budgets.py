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

import fleet_http  # noqa: E402
import harness  # noqa: E402

ENDPOINTS, SIZE = 8, 64
BUDGET = 1_000_000


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
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, harness.bench_redis(Path(tmp)) as url:
        for _ in range(args.rounds):
            for budget in (None, BUDGET):
                rows.append(one(Path(tmp), url, args.requests, budget))
                print(json.dumps(rows[-1]), flush=True)
    result = {"rows": rows, **summary(rows)}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    out = Path(args.out) if args.out else harness.results_path("budgets-")
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
