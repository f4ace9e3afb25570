"""Token budgets seen from outside (docs/api.md, token budgets): two gateway replicas on
the run's Redis, two simulated workers each with a KV cache (`gateway sim --kv-tokens`),
prompts from 10 to 30,000 tokens sent through the official openai SDK faster than the
workers can take them. With budgets, the workers' own counters never see a request wait
and never hold more tokens than their cache, while the caches stay well used (sampled from
the workers' own counters under saturation); with the same load and no budgets (requests
counted only), the workers queue. Nothing is left in Redis, one usage record each.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.conftest import REDIS_URL
from tests.e2e import procs
from tests.e2e.conftest import digest

KEY = "sk-kv-acme"
KV_TOKENS = 65_536  # each worker's cache (4,096 blocks of 16)
MAX_SEQS = 64
ANSWER = 16  # tokens each answer has (the simulator's --tokens), asked as max_tokens
REQUESTS, AT_ONCE = 400, 48
SMALLEST, LARGEST = 10, 30_000


@dataclass
class Run:
    """One load's readings from the workers' own counters."""

    statuses: list[int] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)  # tokens held / cache, both workers
    peak_waiting: int = 0
    peak_tokens: int = 0


def prompt_sizes(seed: int) -> list[int]:
    """Log-uniform from 10 to 30,000 tokens: mostly short, some very long (as real traffic)."""
    rng = random.Random(seed)
    low, high = math.log(SMALLEST), math.log(LARGEST)
    return [int(math.exp(rng.uniform(low, high))) for _ in range(REQUESTS)]


def prompt(tokens: int) -> str:
    """`tokens` words of three letters: 4 bytes each with its space, which the gateway's
    estimate (bytes / 4) and the simulator's count (words) both read as one token."""
    return " ".join(["abc"] * tokens)


def config_text(workers: list[procs.Proc], budgets: bool) -> str:
    budget = f", max_tokens_in_flight: {KV_TOKENS}" if budgets else ""
    endpoints = "".join(
        f'      - {{url: "{w.url}", max_concurrency: {MAX_SEQS}, model: m1{budget}}}\n'
        for w in workers
    )
    return f"""
redis: {{url: "{REDIS_URL}", lease_ttl_s: 10}}
tiers:
  default: {{queue_timeout_s: 60}}
keys:
  - {{sha256: "{digest(KEY)}", account: kv-acme, max_concurrency: 1000}}
models:
  kv:
    max_queue: 1000
    max_tokens_default: {ANSWER}
    endpoints:
{endpoints}"""


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[procs.Proc]]:
    tmp = tmp_path_factory.mktemp("kv-workers")
    extra = ["--kv-tokens", str(KV_TOKENS), "--max-seqs", str(MAX_SEQS),
             "--ttft-ms", "20", "--itl-ms", "15", "--tokens", str(ANSWER)]  # fmt: skip
    started = [procs.sim(tmp, *extra) for _ in range(2)]
    try:
        yield started
    finally:
        for worker in started:
            worker.stop()


def peak(worker: procs.Proc) -> dict[str, Any]:
    """The worker's own counters: now, and the peaks since the last read."""
    found: dict[str, Any] = httpx.get(worker.url + "/sim/peak", timeout=5).json()
    return found


async def sample(workers: list[procs.Proc], run: Run, done: asyncio.Event) -> None:
    """The workers' caches, read every 50 ms until the load is over (a measurement, not a
    synchronisation: nothing waits on it)."""
    async with httpx.AsyncClient(timeout=5) as http:
        while not done.is_set():
            readings = [(await http.get(w.url + "/sim/peak")).json() for w in workers]
            run.samples.append(sum(r["tokens"] for r in readings) / (KV_TOKENS * len(workers)))
            run.peak_waiting = max(run.peak_waiting, *(r["peak_waiting"] for r in readings))
            run.peak_tokens = max(run.peak_tokens, *(r["peak_tokens"] for r in readings))
            await asyncio.sleep(0.05)


async def load(replicas: list[procs.Proc], workers: list[procs.Proc], seed: int) -> Run:
    """REQUESTS completions, AT_ONCE at a time, alternating over the replicas."""
    run = Run()
    for worker in workers:
        peak(worker)  # a fresh window
    sizes = prompt_sizes(seed)
    clients = [
        openai.AsyncOpenAI(base_url=r.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        for r in replicas
    ]
    gate = asyncio.Semaphore(AT_ONCE)

    async def one(i: int) -> None:
        async with gate:
            try:
                await clients[i % len(clients)].completions.create(
                    model="kv", prompt=prompt(sizes[i]), max_tokens=ANSWER
                )
                run.statuses.append(200)
            except openai.APIStatusError as exc:
                run.statuses.append(exc.status_code)

    done = asyncio.Event()
    sampler = asyncio.create_task(sample(workers, run, done))
    try:
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(REQUESTS))), 240)
    finally:
        done.set()
        await sampler
        for client in clients:
            await client.close()
    return run


def saturated(run: Run) -> list[float]:
    """The samples of the middle half of the run, when every client has a request out
    (the ramp-up and the drain at the end left out)."""
    n = len(run.samples)
    return run.samples[n // 4 : 3 * n // 4]


def leftovers() -> dict[str, int]:
    with redis.Redis.from_url(REDIS_URL) as client:
        tag = "gw:v2:{kv}:"
        found = {
            "leases": client.zcard(tag + "leases"),
            "queue": client.zcard(tag + "queue"),
            "ep_of": client.hlen(tag + "ep_of"),
        }
        tokens = client.hgetall(tag + "ep_tok")
        found["tokens"] = sum(int(v) for v in tokens.values())
        return found


def until_clean(limit_s: float = 10.0) -> dict[str, int]:
    """What the model's keys hold once the replicas' last releases landed (they leave after
    each answer: polled, bounded)."""
    deadline = time.monotonic() + limit_s
    left = leftovers()
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        left = leftovers()
    return left


@pytest.mark.parametrize("budgets", [True, False], ids=["budgets", "counted-only"])
def test_budgets_keep_the_caches_full_and_the_workers_from_queueing(
    workers: list[procs.Proc], tmp_path: Path, budgets: bool
) -> None:
    replicas = [procs.gateway(tmp_path, config_text(workers, budgets)) for _ in range(2)]
    try:
        run = asyncio.run(load(replicas, workers, seed=28))
    finally:
        for replica in replicas:
            replica.stop()
    assert run.statuses == [200] * REQUESTS
    assert until_clean() == {"leases": 0, "queue": 0, "ep_of": 0, "tokens": 0}
    busy = saturated(run)
    assert len(busy) >= 10, "the run was too short to sample"
    if budgets:
        # Never a request waiting at a worker, never more tokens than its cache...
        assert run.peak_waiting == 0
        assert run.peak_tokens <= KV_TOKENS
        # ... while the caches stay well used.
        assert statistics.fmean(busy) > 0.70, statistics.fmean(busy)
    else:
        # Counted by requests only, the same load overfills the caches: the workers queue.
        assert run.peak_waiting > 0
