"""What an admitted request costs over HTTP with 10,000 requests waiting (bench/fleet.py
--only queue): the same fleet as bench/fleet_http.py (N simulated endpoints in one process,
CAPACITY slots over them, two `gateway serve` replicas on a real redis-server), loaded three
ways:

- empty: 32 completions at once, below capacity: nobody waits (each request granted at once);
- waiters: CAPACITY + 10,000 at once, one key: 10,000 requests of one account wait all along;
- accounts: the same, each connection with its own key of 10,001 (one account each): 10,000
  accounts wait in the default tier, which shares between accounts (fair share).

Everything Redis does for a request counts: its admission (acquire, the release that hands
its slot on), its start, its usage record, the replicas' sweeps (which keep every lease they
hold and, every fifth round, name every waiter), heartbeats. Redis CPU (INFO used_cpu) and
the replicas' CPU (/proc) are read when the queue is full and again `requests` completions
later, so fill and drain are left out; the queue's depth is read from Redis at both ends.
Every simulator's own peak is checked against its slots.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import fleet_http
import redis
from fleet_http import BODY, CAPACITY, KEY, MODEL, Fleet, account_key, redis_cpu_of, sim_counts

QUEUED = 10_000
# How long a simulated worker takes per request: the fleet serves CAPACITY / SERVICE_MS
# requests a ms, fewer than the replicas take in (so the queue fills: without it the
# replicas' own CPU, not the slots, binds on 2 cores, and nobody waits in Redis).
SERVICE_MS = 2000
LOADS = ("empty", "waiters", "accounts")
RAMP = 2000  # connections opened a second (a listen backlog holds 2,048)


class Window:
    """CPU read at two counts of completed requests: when the queue is full, and `span`
    completions later."""

    def __init__(self, fleet: Fleet, redis_url: str, start: int, span: int) -> None:
        self.fleet, self.start, self.end = fleet, start, start + span
        self.redis_cpu = redis_cpu_of(redis_url)
        self.client = redis.Redis.from_url(redis_url)
        self.done = 0
        self.marks: list[tuple[int, float, float, int]] = []

    def depth(self) -> int:
        return int(self.client.hget("gw:v2:{" + MODEL + "}:ep_load", "~w1") or 0)

    def completed(self) -> None:
        self.done += 1
        if self.done in (self.start, self.end):
            cpu = (self.redis_cpu(), self.fleet.gateway_cpu())
            self.marks.append((self.done, *cpu, self.depth()))

    def result(self) -> dict[str, Any]:
        (n0, r0, g0, d0), (n1, r1, g1, d1) = self.marks
        self.client.close()
        return {
            "redis_cpu_us_per_request": round((r1 - r0) / (n1 - n0) * 1e6, 1),
            "gateway_cpu_us_per_request": round((g1 - g0) / (n1 - n0) * 1e6, 1),
            "waiting_at_start": d0,
            "waiting_at_end": d1,
        }


async def drive(urls: list[str], total: int, concurrency: int, keys: list[str], window: Window):
    """`total` completions, `concurrency` at once, connection i with key i % len(keys)."""
    statuses: dict[int, int] = {}
    left = iter(range(total))
    # A connection per request: with 10,000 waiting this process lags, and a connection
    # it has not reused within uvicorn's 5 s keep-alive is closed under the next request.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:

        async def worker(i: int) -> None:
            await asyncio.sleep(i / RAMP)  # connections opened at RAMP a second, not at once
            headers = {"Authorization": f"Bearer {keys[i % len(keys)]}"}
            url = urls[i % len(urls)] + "/v1/completions"
            for _ in left:
                for _try in range(3):
                    try:
                        async with s.post(url, json=BODY, headers=headers) as answer:
                            await answer.read()
                            statuses[answer.status] = statuses.get(answer.status, 0) + 1
                            break
                    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                        statuses[0] = statuses.get(0, 0) + 1  # sent again (0: a lost connection)
                window.completed()

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return statuses


async def one(tmp: Path, redis_url: str, n: int, load: str, requests: int) -> dict[str, Any]:
    accounts = QUEUED if load == "accounts" else 0
    fleet = Fleet(tmp, redis_url, n, CAPACITY // n, accounts=accounts, ttft_ms=SERVICE_MS)
    try:
        keys = [account_key(i) for i in range(accounts)] or [KEY]
        capacity = (CAPACITY // n) * n
        concurrency = capacity * 9 // 10 if load == "empty" else capacity + QUEUED
        # Connections to every endpoint opened first (as many at once as the empty load).
        await fleet_http.drive(fleet.urls, max(500, 3 * n * 2), capacity * 9 // 10)
        await sim_counts(fleet.base, n)  # a new window
        # Measured from when every connection has had one answer (the queue full) for
        # `requests` completions; as many more after, so the queue stays full throughout.
        window = Window(fleet, redis_url, concurrency, requests)
        began = time.monotonic()
        statuses = await drive(fleet.urls, requests + 2 * concurrency, concurrency, keys, window)
        seconds = time.monotonic() - began
        windows = await sim_counts(fleet.base, n)
    finally:
        fleet.stop()
    peak = max(w["peak_inflight"] for w in windows)
    return {
        "endpoints": n,
        "load": load,
        "at_once": concurrency,
        "requests": requests,
        "statuses": statuses,
        **window.result(),
        "requests_per_s": round(sum(statuses.values()) / seconds),
        "capacity_held": peak <= CAPACITY // n and max(w["peak_waiting"] for w in windows) == 0,
    }


def run(tmp: Path, redis_url: str, requests: int, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for _ in range(rounds):  # rounds interleave the loads: medians after
        for n in (1, 64, 1000):
            for load in LOADS:
                rows.append(asyncio.run(one(tmp, redis_url, n, load, requests)))
                print(rows[-1], flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    fields = ("redis_cpu_us_per_request", "gateway_cpu_us_per_request")
    table = {}
    for n in (1, 64, 1000):
        for load in LOADS:
            mine = [r for r in rows if r["endpoints"] == n and r["load"] == load]
            table[f"{load} n={n}"] = {f: sorted(r[f] for r in mine)[len(mine) // 2] for f in fields}
    ratios = {
        key: {f: round(v[f] / table[f"empty n={key.split('n=')[1]}"][f], 2) for f in fields}
        for key, v in table.items()
    }
    held = all(r["capacity_held"] for r in rows)
    return {"medians": table, "ratio_to_empty_same_n": ratios, "capacity_held": held}
