"""What one admission costs as the fleet grows: Redis CPU and the gateway's own CPU per
admitted request, for a model on 1, 64 and 1,000 endpoints, with an empty queue, with
10,000 waiters of one account and with 10,000 accounts waiting in a fair tier; the same over
HTTP through gateway replicas and simulated workers, with an empty queue ("http") and with
10,000 requests waiting ("queue": bench/fleet_queue.py, everything Redis does for a request
counted, the replicas' sweeps too); and one model's partitions on a 3-master Redis Cluster.

Run: .venv/bin/python bench/fleet.py [--only admission|http|queue|cluster|low] [--quick]
[--out FILE]
(part of `make bench`). Results: bench/results/fleet-<date>.json; figures in bench/README.md.

The admission part drives the admission scripts (routing/store/lua/) through the calls the
gateway builds (routing/admission/slots.py) and the lean RESP client, on a real redis-server
of its own (a free loopback port; or --redis / REDIS_URL, used as it is: only the keys under
`gw:v2:{bench-fleet*}` are written, and removed at the end). No HTTP and no workers: the
endpoints are names, since admission never calls them. The HTTP part and the Cluster run:
bench/fleet_http.py.

One cycle is one admission, and every script call of it is counted:
- empty queue: an acquire granted at once, then its release (the model half full);
- beside 10,000 flex waiters of as many accounts, held back by flex's ceiling (the model
  at 80 %): a default request granted at once, then its release;
- through the queue (none waiting before, "through"; 10 waiters, "short"; 10,000 of one
  account; 10,000 of as many accounts): the model full, D waiters queued; as the gateway
  does it, a new waiter queues
  (acquire), the oldest lease is given back on its endpoint (release), which hands the slot
  to the queue's head, and the head's replica, woken by message, runs its request on the
  grant (no call: its next sweep keeps it, as every lease it holds, whose cost is the same
  for a lease granted at once) and gives it back in a later cycle. So D stays constant, and
  each cycle admits one request through the queue.
Redis CPU is used_cpu_user + sys around the cycles (INFO), per cycle; the gateway's CPU is
this process's CPU time around them (building the calls, encoding, parsing the replies).
Ratios compare each configuration with N = 1 and an empty queue in the same run (granted at
once), and each admission through the queue with N = 1 through an empty one ("through": the
model full, nobody waiting, each request waits for the next release).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

import fleet_http  # noqa: E402
import fleet_low  # noqa: E402
import fleet_queue  # noqa: E402
import harness  # noqa: E402
from rediskit import measured  # noqa: E402

from routing.admission.replies import attempt  # noqa: E402
from routing.admission.slots import (  # noqa: E402
    GRANTED,
    QUEUED,
    ModelSlots,
    Timing,
    make_lease_id,
)
from routing.store.resp import RespClient  # noqa: E402
from routing.store.scripts import Scripts  # noqa: E402
from tiers.policy import Tier  # noqa: E402

TAG = "bench-fleet"
CAPACITY = 2000  # slots of the model, whatever N (N endpoints of CAPACITY // N each)
BATCH = 50  # cycles per round trip
# The queues measured: none (granted at once), none (through the queue: the model full), 10
# waiters, 10,000 of one account, 10,000 of as many accounts; and 10,000 flex waiters held
# back by their tier's ceiling beside requests granted at once.
QUEUES = ("empty", "through", "short", "waiters", "accounts", "beside")
UTILIZATION = {Tier.PRIORITY: 1.0, Tier.DEFAULT: 1.0, Tier.FLEX: 0.8}
FLEX_CEILING = int(CAPACITY * UTILIZATION[Tier.FLEX])
TIMING = Timing(lease_ttl_ms=600_000, claim_ms=600_000, waiter_ttl_ms=600_000)


class Model:
    """One model's slots over `n` endpoints, and the calls of the cycles."""

    def __init__(self, store: RespClient, scripts: Scripts, n: int, name: str) -> None:
        self.store, self.scripts = store, scripts
        size = CAPACITY // n
        urls = [f"http://10.{i // 250}.{i % 250}.1:8000" for i in range(n)]
        self.slots = ModelSlots(name, UTILIZATION, 100_000, TIMING, declare_all=False)
        self.slots.configured = frozenset(urls)
        self.slots.set_endpoints([(u, size, 0.0) for u in urls])
        self.capacity = size * n
        # Leases held, oldest first: (id, endpoint; '' for a waiter's grant).
        self.held: deque[tuple[str, str]] = deque()
        self.waiting: deque[str] = deque()
        self._next = 0

    def new_id(self, account: str) -> str:
        self._next += 1
        return make_lease_id(f"{TAG}-{self._next}", 1, account)

    async def send(self, calls: list[Any]) -> list[Any]:
        replies = await self.scripts.send(self.store, calls)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def setup(
        self, hold: int, waiters: int, accounts: bool, tier: Tier = Tier.DEFAULT
    ) -> None:
        index = self.slots.index()
        assert index is not None
        await self.send([index])
        for start in range(0, hold, 500):
            ids = [self.new_id("h") for _ in range(min(500, hold - start))]
            calls = [self.slots.acquire(i, Tier.DEFAULT, may_wait=False) for i in ids]
            for lease_id, reply in zip(ids, await self.send(calls), strict=True):
                got = attempt(reply)
                assert got.status == GRANTED, got
                self.held.append((lease_id, got.endpoint))
        await self.queue_up(waiters, accounts, tier)

    async def queue_up(self, n: int, accounts: bool, tier: Tier = Tier.DEFAULT) -> None:
        for start in range(0, n, 500):
            ids = [self.waiter_id(accounts) for _ in range(min(500, n - start))]
            calls = [self.slots.acquire(i, tier, may_wait=True) for i in ids]
            for lease_id, reply in zip(ids, await self.send(calls), strict=True):
                assert attempt(reply).status == QUEUED
                self.waiting.append(lease_id)

    def waiter_id(self, accounts: bool) -> str:
        return self.new_id(f"a{self._next}" if accounts else "w")

    async def direct_cycles(self, n: int) -> None:
        """Acquire granted at once, then released: `n` times, BATCH per round trip each."""
        for start in range(0, n, BATCH):
            ids = [self.new_id("d") for _ in range(min(BATCH, n - start))]
            calls = [self.slots.acquire(i, Tier.DEFAULT, may_wait=False) for i in ids]
            got = [attempt(r) for r in await self.send(calls)]
            assert all(g.status == GRANTED for g in got), got[0]
            await self.send(
                [
                    self.slots.release([i], endpoint=g.endpoint)
                    for i, g in zip(ids, got, strict=True)
                ]
            )

    async def queued_cycles(self, n: int, accounts: bool, wakes: aioredis.client.PubSub) -> None:
        """As the gateway does it: a newcomer queues; the oldest lease is given back (on its
        endpoint), which hands the slot to the queue's head; the head's replica, woken by
        message, runs its request on the grant and gives it back in a later cycle."""
        waiting = deque(self.waiting)
        for start in range(0, n, BATCH):
            calls: list[Any] = []
            size = min(BATCH, n - start)
            for _ in range(size):
                newcomer = self.waiter_id(accounts)
                calls.append(self.slots.acquire(newcomer, Tier.DEFAULT, may_wait=True))
                lease_id, endpoint = self.held.popleft()
                calls.append(self.slots.release([lease_id], endpoint=endpoint))
                waiting.append(newcomer)
            replies = await self.send(calls)
            assert all(int(r) == 1 for r in replies[1::2]), "a release granted no waiter"
            granted = [await self._woken(wakes) for _ in range(size)]
            for waiter_id, endpoint in granted:
                assert waiter_id == waiting.popleft()
                self.held.append((waiter_id, endpoint))
        self.waiting = waiting

    @staticmethod
    async def _woken(wakes: aioredis.client.PubSub) -> tuple[str, str]:
        """The next grant's wake-up (the subscription's own confirmation skipped)."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            message = await wakes.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None:
                waiter_id, _, endpoint = message["data"].decode().partition(" ")
                return waiter_id, endpoint
        raise AssertionError("a grant's wake-up never came")

    async def clear(self, info: aioredis.Redis) -> None:
        for key in self.slots.keys:
            await info.delete(key)
        async for key in info.scan_iter(match="gw:v2:{" + self.slots.model + "}:*", count=1000):
            await info.delete(key)


async def one(url: str, info: aioredis.Redis, n: int, queue: str, cycles: int) -> dict[str, Any]:
    """One configuration: N endpoints, its queue (one of QUEUES)."""
    store = RespClient(url)
    scripts = Scripts()
    await scripts.load(store)
    model = Model(store, scripts, n, f"{TAG}-{n}-{queue}")
    depth = {"empty": 0, "through": 0, "short": 10}.get(queue, 10_000)
    wakes = info.pubsub()
    await wakes.subscribe(model.slots.channel)
    try:
        at_once = queue in ("empty", "beside")
        # Half full; or at flex's ceiling (its waiters held back, room for the others).
        hold = {"empty": model.capacity // 2, "beside": FLEX_CEILING}.get(queue, model.capacity)
        tier = Tier.FLEX if queue == "beside" else Tier.DEFAULT
        await model.setup(hold, depth, queue in ("accounts", "beside"), tier)
        work = (
            model.direct_cycles(cycles)
            if at_once
            else model.queued_cycles(cycles, queue == "accounts", wakes)
        )
        cpu = time.process_time()
        delta = await measured(info, work)
        mine = time.process_time() - cpu
    finally:
        await wakes.aclose()
        await model.clear(info)
        await store.aclose()
    return {
        "endpoints": n,
        "queue": queue,
        "waiting": depth,
        "cycles": cycles,
        "redis_cpu_us_per_admission": round(delta.cpu_s / cycles * 1e6, 2),
        "redis_cmd_us_per_admission": round(sum(delta.usec.values()) / cycles, 2),
        "gateway_cpu_us_per_admission": round(mine / cycles * 1e6, 2),
    }


async def measure(url: str, cycles: int, rounds: int) -> list[dict[str, Any]]:
    info = aioredis.Redis.from_url(url)
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(rounds):  # rounds interleave the configurations: medians after
            for queue in QUEUES:
                for n in (1, 64, 1000):
                    rows.append(await one(url, info, n, queue, cycles))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        await info.aclose()
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def median(n: int, queue: str, field: str) -> float:
        values = sorted(r[field] for r in rows if r["endpoints"] == n and r["queue"] == queue)
        return values[len(values) // 2]

    fields = ("redis_cpu_us_per_admission", "gateway_cpu_us_per_admission")
    table = {
        f"{queue} n={n}": {f: median(n, queue, f) for f in fields}
        for queue in QUEUES
        for n in (1, 64, 1000)
    }
    base = table["empty n=1"]
    queued = table["through n=1"]
    ratios = {key: {f: round(v[f] / base[f], 2) for f in fields} for key, v in table.items()}
    through_queue = {
        key: {f: round(v[f] / queued[f], 2) for f in fields}
        for key, v in table.items()
        if not key.startswith(("empty", "beside"))
    }
    return {
        "medians": table,
        "ratio_to_empty_n1": ratios,
        "ratio_to_through_empty_queue_n1": through_queue,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4000, help="per HTTP configuration")
    parser.add_argument("--quick", action="store_true", help="a short run; no results file")
    parts = ["admission", "http", "queue", "cluster", "low"]
    parser.add_argument("--only", choices=parts, default=None)
    parser.add_argument("--queued", type=int, default=6000, help="per HTTP queue configuration")
    parser.add_argument("--queue-rounds", type=int, default=1, help="about 15 minutes each")
    parser.add_argument("--redis", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cycles, rounds = (200, 1) if args.quick else (args.cycles, args.rounds)
    requests = 600 if args.quick else args.requests
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, harness.bench_redis(Path(tmp), args.redis) as url:
        if args.only in (None, "admission"):
            rows = asyncio.run(measure(url, cycles, rounds))
            result["admission"] = {"rows": rows, **summary(rows)}
            print(json.dumps(result["admission"]["ratio_to_empty_n1"], indent=1))
            print(json.dumps(result["admission"]["ratio_to_through_empty_queue_n1"], indent=1))
        if args.only in (None, "http"):
            rows = fleet_http.single(Path(tmp), url, requests, rounds)
            result["http"] = {"rows": rows, **http_summary(rows)}
            print(json.dumps(result["http"]["ratio_to_n1"], indent=1))
        if args.only in (None, "low"):
            rows = fleet_low.run(Path(tmp), url, rounds, 300 if args.quick else fleet_low.REQUESTS,
                                 5.0 if args.quick else fleet_low.IDLE_S)  # fmt: skip
            result["low"] = {"rows": rows, **fleet_low.summary(rows)}
            print(json.dumps(result["low"]["ratio_to_n1"], indent=1))
        if args.only in (None, "queue"):
            queued = 3000 if args.quick else args.queued
            rows = fleet_queue.run(Path(tmp), url, queued, args.queue_rounds)
            result["queue"] = {"rows": rows, **fleet_queue.summary(rows)}
            print(json.dumps(result["queue"]["ratio_to_empty_same_n"], indent=1))
    if args.only in (None, "cluster"):
        with tempfile.TemporaryDirectory() as tmp:
            result["cluster"] = fleet_http.partitioned(Path(tmp), requests)
        print(json.dumps(result["cluster"]["masters"], indent=1))
        print("capacity held:", result["cluster"]["capacity_held"])
    if not args.quick:
        out = Path(args.out) if args.out else harness.results_path("fleet-")
        out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"results: {out}")


def http_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    fields = ("redis_cpu_us_per_request", "gateway_cpu_us_per_request")
    table = {}
    for n in (1, 64, 1000):
        mine = [r for r in rows if r["endpoints"] == n]
        table[f"n={n}"] = {f: sorted(r[f] for r in mine)[len(mine) // 2] for f in fields}
    base = table["n=1"]
    ratios = {key: {f: round(v[f] / base[f], 2) for f in fields} for key, v in table.items()}
    held = all(r["capacity_held"] for r in rows)
    return {"medians": table, "ratio_to_n1": ratios, "capacity_held": held}


if __name__ == "__main__":
    main()
