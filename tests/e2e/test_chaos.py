"""The randomized fault test (issue 10): two gateway replicas on one private Redis while, at
random, Redis restarts empty (or from its AOF), stalls, a replica is killed and replaced,
and clients hang up. The promises of docs/architecture.md and docs/usage.md are checked
throughout and at the end. Bounded: at most MAX_REQUESTS requests over TRAFFIC_S seconds.

The seed comes from $GATEWAY_CHAOS_SEED (else it is random); it is printed and is in every
assertion message, so a failure replays (the same requests and the same faults in the same
order; their interleaving depends on the machine).

What is checked, and how it could fail (tests/e2e/chaos_checks.py):
1. Each worker's requests in flight <= its max_concurrency, from the worker's own view: the
   exact spans of its requests (one clock for all processes) and the peaks polled every
   POLL_S. docs/api.md: never exceeded by more than what was admitted before the write-back;
   so at most twice the limit, and outside the grace windows (an empty restart's kill
   until GRACE_S after Redis answers again) at most the limit plus the requests still
   running that began within a grace window. Fails if a replica admits
   against leases Redis lost and nobody wrote back, or two replicas share a last slot.
   Two lanes of long streams (HOLD_TOKENS) keep work in flight across most empty restarts,
   so a missing write-back shows as an overshoot past the grace (the report says how many
   restarts were so covered).
2. The account of max_concurrency 3 never has more than 3 requests at the workers at once
   (twice in the grace): fails if account entries are lost and not written back, or a
   request runs uncounted. Counted at the workers, not from the clients (whose view of
   "in flight" is not the gateway's) nor from Redis (which is what the gateway believes).
3. Every request is answered within its tier's queue timeout + command_timeout_s + one
   sweep + WAIT_MARGIN_S, not counting the time its replica or Redis waited for a CPU
   meanwhile (tests/e2e/starvation.py: a busy machine is not a gateway waiting); none goes
   unanswered except a client hang-up or a connection to a replica the test killed.
4. Usage records: Redis restarted empty loses the records it held, so the test keeps each
   emptied Redis's append-only file aside and reads them all after the run: every request
   that reached a worker or got a 2xx from a replica that lived RECORD_MARGIN_S past its
   end has exactly one record, across every Redis of the run; none has two; none for a
   request refused before admission (429, 503).
5. After the traffic (the faults over, Redis answering), the live replicas clean Redis by
   themselves within CLEAN_DEADLINE_S (dead replicas' leases expire by lease_ttl_s, their
   waiters by the waiter TTL): no lease, waiter, endpoint load or account entry left, and
   still none after the replicas stop (SIGTERM).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.e2e import procs
from tests.e2e.chaos_checks import (
    Seen,
    SpanRow,
    covered,
    graces,
    hung_up,
    outages,
    overshoot,
    peaks_over,
    records,
    unanswered,
    waits,
    watch,
)
from tests.e2e.chaos_fleet import (
    REAL_FAULTS,
    ChaosFleet,
    Fault,
    read_epoch,
    read_usage,
)
from tests.e2e.chaos_traffic import Driver, Outcome
from tests.e2e.conftest import digest
from tests.e2e.starvation import Starvation, sample_until
from tests.redis_server import RedisServer, endpoint_load

SEED_ENV = "GATEWAY_CHAOS_SEED"
MAX_REQUESTS = 2000
TRAFFIC_S = 30.0
IN_FLIGHT = 24
FAULT_EVERY_S = (1.0, 3.0)
FAULT_WEIGHTS = {"restart_empty": 3, "restart_kept": 1, "pause": 3, "kill_replica": 2, "nothing": 1}
PAUSE_S = (0.5, 2.0)
LEASE_TTL_S = 3.0
COMMAND_TIMEOUT_S = 0.5
SWEEP_S = LEASE_TTL_S / 4  # the gateway's sweep: min(1 s, lease_ttl_s / 4)
WAITER_TTL_S = 3.0  # routing/admission/slots.py Timing: max(3 s, 3 sweeps)
QUEUE_TIMEOUT_S = {"priority": 4.0, "default": 3.0, "flex": 2.0}
WORKER_CAP = 2  # max_concurrency of each of the two endpoints (the sims run up to 8)
LIMITS = {"chaos-tight": 3, "chaos-wide": 100}  # accounts' max_concurrency
ACCOUNTS = ("chaos-tight", "chaos-wide", "chaos-wide")  # drawn in this proportion
GRACE_S = 1.5
WAIT_MARGIN_S = 1.5
RECORD_MARGIN_S = 2.0
POLL_S = 0.15
OUTAGE_MARGIN_S = 1.0  # a 503 this long after Redis answers again is still the outage's
ITL_MS = 5
HOLD_TOKENS = 1000  # the long streams: 5 s at ITL_MS, longer than the lease TTL and a grace
CLEAN_DEADLINE_S = LEASE_TTL_S + WAITER_TTL_S + 2.0
CLIENT_TIMEOUT_S = max(QUEUE_TIMEOUT_S.values()) + 6.0
MODEL = "m"


def keys() -> dict[str, str]:
    return {account: f"sk-{account}" for account in LIMITS}


def chaos_config(redis_url: str, sims: list[procs.Proc], spool: Path) -> str:
    tiers = "\n".join(f"  {t}: {{queue_timeout_s: {s}}}" for t, s in QUEUE_TIMEOUT_S.items())
    endpoints = "\n".join(
        f'      - {{url: "{s.url}", max_concurrency: {WORKER_CAP}, model: m1}}' for s in sims
    )
    accounts = "\n".join(
        f'  - {{sha256: "{digest(key)}", account: {account}, max_concurrency: {LIMITS[account]}}}'
        for account, key in keys().items()
    )
    return f"""
redis: {{url: "{redis_url}", lease_ttl_s: {LEASE_TTL_S}, command_timeout_s: {COMMAND_TIMEOUT_S},
         on_outage: reject}}
usage: {{spool_dir: "{spool}"}}
tiers:
{tiers}
models:
  {MODEL}:
    tiers: [default, priority, flex]
    max_queue: 8
    endpoints:
{endpoints}
keys:
{accounts}
"""


@pytest.fixture
def chaos(tmp_path: Path) -> Iterator[tuple[ChaosFleet, list[procs.Proc]]]:
    server = RedisServer(tmp_path, persistent=True).start()
    sims: list[procs.Proc] = []
    fleet: ChaosFleet | None = None
    try:
        for _ in range(2):
            sims.append(
                procs.sim(tmp_path, "--max-seqs", "8", "--ttft-ms", "5", "--itl-ms", str(ITL_MS),
                          "--tokens", str(HOLD_TOKENS))
            )  # fmt: skip
        spool = tmp_path / "spool"
        spool.mkdir()
        fleet = ChaosFleet(tmp_path, server, chaos_config(server.url, sims, spool), PAUSE_S)
        for _ in range(2):
            fleet.start_replica()
        yield fleet, sims
    finally:
        if fleet is not None:
            fleet.stop()
        server.stop()
        for sim in sims:
            sim.stop()


async def inject_faults(fleet: ChaosFleet, rng: random.Random, until: float) -> None:
    """One fault every 1-3 s until `until`: each real kind once first, in random order."""
    first = list(REAL_FAULTS)
    rng.shuffle(first)
    kinds, weights = zip(*FAULT_WEIGHTS.items(), strict=True)
    while True:
        await asyncio.sleep(rng.uniform(*FAULT_EVERY_S))
        if time.monotonic() >= until:
            return
        kind = first.pop(0) if first else rng.choices(kinds, weights)[0]
        await asyncio.to_thread(fleet.inject, kind, rng)


def leftovers(url: str) -> list[str]:
    """What admission still holds in Redis: leases, waiters, endpoint loads, account entries."""
    client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=2)
    try:
        tag = "gw:v2:{" + MODEL + "}:"
        left = [
            f"{tag}{k}: {n}" for k in ("leases", "queue", "qexp") if (n := client.zcard(tag + k))
        ]
        if n := client.hlen(tag + "ep_of"):
            left.append(f"{tag}ep_of: {n}")
        if load := endpoint_load(client.hgetall(tag + "ep_load")):
            left.append(f"{tag}ep_load sums to {load}")
        for key in client.scan_iter(match="gw:v2:acct:*"):
            if n := client.zcard(key):
                left.append(f"{key}: {n}")
        return left
    finally:
        client.close()


def wait_clean(url: str, spool: Path, limit_s: float) -> tuple[float, list[str]]:
    """Poll (another process's state has no event) until Redis holds nothing and every spool
    is sent; how long it took, or what is left at the deadline."""
    start = time.monotonic()
    while True:
        left = leftovers(url)
        left += [f"spool {p.name}" for p in spool.glob("*.jsonl") if p.stat().st_size]
        if not left or time.monotonic() - start > limit_s:
            return time.monotonic() - start, left
        time.sleep(0.1)


def answers(outcomes: list[Outcome]) -> Counter[str]:
    return Counter(
        f"{o.status} {o.code}".strip() if o.status is not None else o.code for o in outcomes
    )


@pytest.mark.timeout(100)
async def test_random_faults_keep_every_promise(
    chaos: tuple[ChaosFleet, list[procs.Proc]],
) -> None:
    fleet, sims = chaos
    seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(10**9))
    print(f"chaos seed {seed} (replay: {SEED_ENV}={seed})")
    t0 = time.monotonic()
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch({f"w{i}": s.url for i, s in enumerate(sims)}, stop, POLL_S))
    sampler = asyncio.create_task(sample_until(lambda: on_path(fleet), stop, POLL_S))
    faults = asyncio.create_task(inject_faults(fleet, random.Random(seed), t0 + TRAFFIC_S))
    driver = Driver(seed, fleet, keys(), ACCOUNTS, CLIENT_TIMEOUT_S, HOLD_TOKENS)
    await driver.run(MAX_REQUESTS, TRAFFIC_S, IN_FLIGHT)
    await faults
    clean_s, left = await asyncio.to_thread(
        wait_clean, fleet.redis.url, fleet.tmp / "spool", CLEAN_DEADLINE_S
    )
    stop.set()
    seen = await watcher
    starved = await sampler
    for replica in fleet.live:
        await asyncio.to_thread(replica.proc.stop)
    left_after_stop = leftovers(fleet.redis.url)
    epochs = [read_usage(fleet.redis.url)]
    epochs += [read_epoch(e, fleet.tmp) for e in fleet.epochs]
    cleaned = (clean_s, left, left_after_stop)
    verdict(seed, t0, fleet, driver.outcomes, seen, epochs, cleaned, starved)


def on_path(fleet: ChaosFleet) -> list[int]:
    """The processes a request's answer waits on: the live replicas and Redis."""
    popens = [r.proc.popen for r in fleet.live] + [fleet.redis.popen]
    return [p.pid for p in popens if p is not None and p.poll() is None]


Report = tuple[list[str], list[str]]  # figures for the report, violations


def verdict(
    seed: int,
    t0: float,
    fleet: ChaosFleet,
    outcomes: list[Outcome],
    seen: Seen,
    epochs: list[list[dict[str, str]]],
    cleaned: tuple[float, list[str], list[str]],
    starved: Starvation,
) -> None:
    """Print the run's figures; fail with every violation, the seed and the figures."""
    due = {o.spec.rid: o.sent + (o.spec.hangup_s or 0) for o in outcomes if o.code == "hangup"}
    spans = {w: hung_up(rows, due) for w, rows in seen.spans.items()}
    report = [
        f"chaos seed {seed}: {len(outcomes)} requests in "
        f"{max(o.ended for o in outcomes) - t0:.1f}s",
        f"answers: {dict(sorted(answers(outcomes).items()))}",
        f"faults: {dict(Counter(f.kind for f in fleet.faults))}",
        "fault log: "
        + ", ".join(f"{f.start - t0:.1f}s {f.kind} {f.detail}".strip() for f in fleet.faults),
    ]
    violations: list[str] = []
    for figures, found in (
        judge_load(t0, fleet, outcomes, seen, spans, due),
        judge_answers(t0, fleet, outcomes, starved),
        judge_records(fleet.faults, outcomes, epochs, spans, seen.dropped),
        judge_cleanup(*cleaned),
    ):
        report += figures
        violations += found
    print("\n".join(report))
    shown = "\n".join(violations[:40])
    summary = "\n".join(report)
    assert not violations, f"seed {seed}: {len(violations)} violations:\n{shown}\n{summary}"


def judge_load(
    t0: float,
    fleet: ChaosFleet,
    outcomes: list[Outcome],
    seen: Seen,
    spans: dict[str, list[SpanRow]],
    due: dict[str, float],
) -> Report:
    grace = graces(fleet.faults, GRACE_S)
    workers = {
        w: overshoot(f"worker {w}", rows, WORKER_CAP, grace, t0) for w, rows in spans.items()
    }
    tight_rids = {o.spec.rid for o in outcomes if o.spec.account == "chaos-tight"}
    tight = [row for rows in spans.values() for row in rows if row[0] in tight_rids]
    account = overshoot("account chaos-tight", tight, LIMITS["chaos-tight"], grace, t0)
    polled = peaks_over(seen.windows, WORKER_CAP, grace, seen.spans, due, t0)
    restarts = sum(1 for f in fleet.faults if f.kind == "restart_empty")
    tested = covered(fleet.faults, [r for rows in spans.values() for r in rows], GRACE_S, "-hold")
    figures = [
        "worker overshoot inside grace (settled after) / carried past it / otherwise: "
        + ", ".join(
            f"{w} +{o.inside} ({o.settled_s:.2f}s) / +{o.carried} / +{o.outside}"
            for w, o in sorted(workers.items())
        ),
        f"polled peaks: max {max((w.peak for w in seen.windows), default=0)}, "
        f"{len(polled)} windows over the bound",
        f"account chaos-tight overshoot inside grace (settled after) / carried / otherwise: "
        f"+{account.inside} ({account.settled_s:.2f}s) / +{account.carried} / +{account.outside}",
        f"empty restarts with a long stream in flight throughout the grace: {tested} of {restarts}",
    ]
    found = [v for o in workers.values() for v in o.where] + account.where + polled
    return figures, found


def judge_answers(
    t0: float, fleet: ChaosFleet, outcomes: list[Outcome], starved: Starvation
) -> Report:
    slack_s = COMMAND_TIMEOUT_S + SWEEP_S + WAIT_MARGIN_S
    waited = waits(outcomes, QUEUE_TIMEOUT_S, slack_s, starved.during)
    relief = max((starved.during(o.sent, o.answered) for o in outcomes), default=0.0)
    refused, unexplained = outages(outcomes, fleet.faults, OUTAGE_MARGIN_S, t0)
    figures = [
        f"503s: {refused}, {len(unexplained)} while Redis was well",
        f"longest wait {waited.longest_s:.2f}s, fail-fast {waited.fail_fast_s:.2f}s, "
        f"past the queue timeout {waited.overrun_s:.2f}s (CPU waits on a request's path not "
        f"counted, at most {relief:.2f}s)",
    ]
    return figures, waited.late + unexplained + unanswered(outcomes)


def judge_records(
    faults: list[Fault],
    outcomes: list[Outcome],
    epochs: list[list[dict[str, str]]],
    spans: dict[str, list[SpanRow]],
    dropped: int,
) -> Report:
    reached = {row[0] for rows in spans.values() for row in rows}
    lost_at = [0.0] + [f.wall for f in faults if f.kind == "restart_empty"]
    billed = records(outcomes, epochs, lost_at, reached, RECORD_MARGIN_S)
    figures = [
        f"records: {billed.checked} required, {len(billed.missing)} missing, "
        f"{len(billed.duplicated)} duplicated, {len(billed.unexpected)} unexpected, "
        f"{len(billed.resurrected)} in two epochs {billed.resurrected[:3]}, "
        f"over {len(epochs)} Redis epochs; spans dropped {dropped}",
    ]
    found = billed.missing + billed.duplicated + billed.unexpected
    if dropped:
        found.append(f"{dropped} spans dropped by the workers: the load check is blind")
    return figures, found


def judge_cleanup(clean_s: float, left: list[str], left_after_stop: list[str]) -> Report:
    figures = [f"Redis clean {clean_s:.2f}s after the traffic"]
    found = [f"left in Redis after the traffic: {x}" for x in left]
    found += [f"left in Redis after the replicas stopped: {x}" for x in left_after_stop]
    return figures, found
