"""Fair share inside a tier, end to end (docs/config.md, fair share): real Redis, one and two
gateway replicas, a simulated worker of capacity 4. The grant order is read back from the
usage records: a request arrived at `ts - duration_ms` and was admitted `queue_ms` later.

Bounded: a few hundred short requests per test (about 80 ms of simulated work each).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REDIS_URL
from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.redis_server import free_port

RUN = uuid.uuid4().hex[:8]
CAPACITY = 4


@dataclass
class Fleet:
    gateways: list[procs.Proc]
    config: Path
    model: str
    accounts: dict[str, str]  # key -> account


@dataclass(frozen=True)
class Grant:
    account: str
    tier: str
    arrived: float  # seconds (epoch)
    admitted: float


def config_text(worker: procs.Proc, model: str, fairness: str, keys: dict[str, tuple[str, float]],
                tmp: Path) -> str:  # fmt: skip
    listed = "".join(
        f'  - {{sha256: "{digest(key)}", account: "{account}", max_concurrency: 1000, '
        f"weight: {weight}}}\n"
        for key, (account, weight) in keys.items()
    )
    return (
        f'redis: {{url: "{REDIS_URL}"}}\n'
        f'usage: {{spool_dir: "{tmp}/spool-{free_port()}"}}\n'
        "tiers:\n"
        f"  default: {{queue_timeout_s: 60, fairness: {fairness}}}\n"
        "  priority: {queue_timeout_s: 60}\n"
        f"models:\n  {model}:\n    tiers: [default, priority]\n    max_queue: 1000\n"
        f'    endpoints: [{{url: "{worker.url}", max_concurrency: {CAPACITY}, model: m1}}]\n'
        f"keys:\n{listed}"
    )


@pytest.fixture
def fleet_of(tmp_path: Path) -> Iterator[Any]:
    started: list[procs.Proc] = []

    def make(fairness: str, replicas: int, weights: tuple[float, float] = (1, 1)) -> Fleet:
        name = f"fair-{fairness}-{replicas}-{uuid.uuid4().hex[:6]}"
        keys = {
            f"sk-{name}-{who}": (f"{who}-{name}", w) for who, w in zip("ab", weights, strict=True)
        }
        worker = procs.sim(tmp_path, "--max-seqs", "64", "--ttft-ms", "40", "--itl-ms", "10",
                           "--tokens", "4")  # fmt: skip
        started.append(worker)
        text = config_text(worker, name, fairness, keys, tmp_path)
        gateways = []
        for _ in range(replicas):
            gateways.append(procs.gateway(tmp_path, text))
            started.append(gateways[-1])
        config = tmp_path / f"gateway-{gateways[0].port}.yaml"
        return Fleet(gateways, config, name, {k: a for k, (a, _) in keys.items()})

    yield make
    for proc in started:
        proc.stop()


async def send(client: httpx.AsyncClient, fleet: Fleet, key: str, n: int, i: int,
               tier: str = "default") -> None:  # fmt: skip
    url = fleet.gateways[i % len(fleet.gateways)].url + "/v1/chat/completions"
    body = {"model": fleet.model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "service_tier": tier}  # fmt: skip
    response = await client.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


def client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    return httpx.AsyncClient(limits=limits, timeout=60)


def grants(fleet: Fleet, expected: int) -> list[Grant]:
    """The usage records of the fleet's accounts (waits for all `expected`), in grant order."""
    deadline = time.monotonic() + 20
    while True:
        out = subprocess.run(
            [sys.executable, "-m", "gateway", "usage", "export", "--config", str(fleet.config)],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        mine = [r for r in records if r["account"] in fleet.accounts.values()]
        if len(mine) >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # another process's stream: no event to wait on
    assert len(mine) == expected
    found = []
    for r in mine:
        end = datetime.fromisoformat(r["ts"]).timestamp()
        arrived = end - r["duration_ms"] / 1000
        found.append(Grant(r["account"], r["tier"], arrived, arrived + r["queue_ms"] / 1000))
    return sorted(found, key=lambda g: g.admitted)


def grants_before(order: list[Grant], grant: Grant) -> int:
    """How many grants went between this request's arrival and its own."""
    return sum(1 for g in order if grant.arrived < g.admitted < grant.admitted)


async def queued(http: httpx.AsyncClient, fleet: Fleet) -> float:
    """Requests waiting in the fleet's default queue, as the replicas report it."""
    sample = f'gateway_queue_depth{{model="{fleet.model}",tier="default"}} '
    depth = 0.0
    for gateway in fleet.gateways:
        for line in (await http.get(gateway.url + "/metrics")).text.splitlines():
            if line.startswith(sample):
                depth = max(depth, float(line.rsplit(" ", 1)[1]))
    return depth


async def flood_then_latecomers(fleet: Fleet) -> None:
    """A sends 200 at once; B sends 10 a second later (and once A's flood is queued, so a
    slow machine does not change the scenario), and one priority request."""
    key_a, key_b = list(fleet.accounts)
    async with client() as http:
        flood = [asyncio.create_task(send(http, fleet, key_a, 200, i)) for i in range(200)]
        await asyncio.sleep(1.0)  # the scenario itself: B arrives a second into A's flood
        for _ in range(200):  # at most 10 s more
            if await queued(http, fleet) >= 100:
                break
            await asyncio.sleep(0.05)  # another process's gauge: no event to wait on
        late = [send(http, fleet, key_b, 10, i) for i in range(10)]
        late.append(send(http, fleet, key_b, 1, 0, tier="priority"))
        await asyncio.gather(*flood, *late)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_flood_delays_only_its_own_account(fleet_of: Any, replicas: int) -> None:
    fleet = fleet_of("accounts", replicas)
    asyncio.run(flood_then_latecomers(fleet))
    order = grants(fleet, 211)
    b_name = list(fleet.accounts.values())[1]
    late = [g for g in order if g.account == b_name and g.tier == "default"]
    assert len(late) == 10
    # B's requests went in within about 20 grants of arriving (A's ~100 still queued).
    worst = max(grants_before(order, g) for g in late)
    print(f"fair, {replicas} replica(s): B's last grant {worst} grants after it arrived")
    assert worst <= 24
    a_after = [g for g in order if g.account != b_name and g.admitted > late[-1].admitted]
    assert len(a_after) > 20  # A's flood was still queued when B was done
    # The priority request went before every default waiter of either account.
    # (A few grants may land while its call is on the way to Redis: at most a slot each.)
    (vip,) = [g for g in order if g.tier == "priority"]
    assert grants_before(order, vip) <= CAPACITY
    overtaken = [g for g in order if g.arrived < vip.arrived and g.admitted > vip.admitted]
    assert len(overtaken) > 20


def test_fifo_serves_in_arrival_order(fleet_of: Any) -> None:
    fleet = fleet_of("fifo", 1)
    asyncio.run(flood_then_latecomers(fleet))
    order = grants(fleet, 211)
    b_name = list(fleet.accounts.values())[1]
    first_b = min(g.admitted for g in order if g.account == b_name and g.tier == "default")
    # Every one of A's 200 went first (a grant or two may share B's millisecond).
    a_after = sum(1 for g in order if g.account != b_name and g.admitted > first_b)
    print(f"fifo: {a_after} of A's granted after B's first")
    assert a_after <= 2


async def saturate(fleet: Fleet, seconds: float) -> tuple[float, float, int]:
    """Both accounts keep 16 requests going each for `seconds` (bounded: at most 2000 in
    all); the window both saturated, and how many were sent."""
    stop = time.time() + seconds
    sent = 0

    async def loop(http: httpx.AsyncClient, key: str, i: int) -> None:
        nonlocal sent
        while time.time() < stop and sent < 2000:
            sent += 1
            await send(http, fleet, key, 1, i)

    start = time.time()
    async with client() as http:
        await asyncio.gather(*(loop(http, key, i) for key in fleet.accounts for i in range(16)))
    return start + 0.5, stop, sent


def test_weights_split_the_served_requests(fleet_of: Any) -> None:
    fleet = fleet_of("accounts", 1, weights=(3, 1))
    frm, to, sent = asyncio.run(saturate(fleet, 4.0))
    served = {"a": 0, "b": 0}
    order = grants(fleet, sent)
    for g in order:
        if frm <= g.admitted <= to:
            served[g.account[0]] += 1
    print(f"weights 3:1, served while both saturated: {served}")
    assert served["b"] > 20
    assert 2.7 <= served["a"] / served["b"] <= 3.3, served
