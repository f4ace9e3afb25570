"""Preemption of flex seen from outside (docs/api.md, preemption of flex): two gateway
replicas on the run's Redis, one simulated worker of four slots whose answers begin only
after 1.5 s. Four flex streams fill it through one replica, none begun; then priority
requests come through the other. Each priority request takes the slot of a flex request
that had sent nothing (the worker sees that request aborted) and is served without waiting
for any flex request to end; the preempted callers get 429 `preempted` (reject) or are
served after all (requeue); the worker never runs more than four; one usage record per
admission, the preempted ones marked; nothing left in Redis.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.conftest import REDIS_URL
from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.e2e.test_usage import records_for, wait_for

KEY = "sk-preempt-acme"
SLOTS, PRIORITY = 4, 2


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[procs.Proc]:
    tmp = tmp_path_factory.mktemp("preempt-worker")
    sim = procs.sim(tmp, "--max-seqs", str(SLOTS), "--ttft-ms", "1500", "--itl-ms", "20",
                    "--tokens", "8")  # fmt: skip
    try:
        yield sim
    finally:
        sim.stop()


def config_text(worker: procs.Proc, on_preempt: str) -> str:
    return f"""
redis: {{url: "{REDIS_URL}", lease_ttl_s: 10}}
tiers:
  flex: {{max_utilization: 1.0, queue_timeout_s: 30, on_preempt: {on_preempt}}}
  priority: {{queue_timeout_s: 30}}
keys:
  - {{sha256: "{digest(KEY)}", account: preempt-acme, max_concurrency: 100}}
models:
  pre:
    tiers: [default, priority, flex]
    endpoints: [{{url: "{worker.url}", max_concurrency: {SLOTS}, model: m1}}]
"""


def window(worker: procs.Proc) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(worker.url + "/sim/peak", timeout=5).json()
    return found


def leases() -> int:
    with redis.Redis.from_url(REDIS_URL) as client:
        return int(client.zcard("gw:v2:{pre}:leases"))


def leftovers() -> dict[str, int]:
    with redis.Redis.from_url(REDIS_URL) as client:
        tag = "gw:v2:{pre}:"
        return {k: int(client.zcard(tag + k)) for k in ("leases", "queue", "doomed", "pre")}


def flex_stream(url: str, rid: str, results: dict[str, Any]) -> None:
    """One flex stream read to its end: its status, or its error's code."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    try:
        stream = client.completions.create(
            model="pre", prompt="hello", max_tokens=8, stream=True,
            extra_body={"service_tier": "flex"}, extra_headers={"x-request-id": rid},
        )  # fmt: skip
        results[rid] = 200 if sum(1 for _ in stream) > 0 else 0
    except openai.APIStatusError as exc:
        results[rid] = exc.code or exc.status_code
    finally:
        client.close()


def priority(url: str, rid: str, results: dict[str, Any]) -> None:
    """One priority request: the tier it was served at, or its error's code."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    try:
        answer = client.completions.create(
            model="pre", prompt="urgent", max_tokens=4,
            extra_body={"service_tier": "priority"}, extra_headers={"x-request-id": rid},
        )  # fmt: skip
        results[rid] = (answer.model_extra or {}).get("service_tier")  # not in openai's types
    except openai.APIStatusError as exc:
        results[rid] = exc.code or exc.status_code
    finally:
        client.close()


@pytest.mark.parametrize("on_preempt", ["reject", "requeue"])
def test_priority_takes_the_slots_of_flex_requests_that_have_not_begun(
    worker: procs.Proc, tmp_path: Path, on_preempt: str
) -> None:
    text = config_text(worker, on_preempt)
    replicas = [procs.gateway(tmp_path, text) for _ in range(2)]
    config = tmp_path / "records.yaml"
    config.write_text(text)
    run = f"{on_preempt}-{time.time_ns()}"
    window(worker)  # a fresh window of the worker's own counters
    try:
        flex: dict[str, Any] = {}
        flex_ids = [f"flex-{run}-{i}" for i in range(SLOTS)]
        threads = [
            threading.Thread(target=flex_stream, args=(replicas[0].url, rid, flex))
            for rid in flex_ids
        ]
        for thread in threads:
            thread.start()
        wait_for(lambda: leases() == SLOTS, "the flex streams to hold every slot")
        # The priority requests together, while every slot is a flex stream not begun.
        vip: dict[str, Any] = {}
        vip_ids = [f"vip-{run}-{i}" for i in range(PRIORITY)]
        urgent = [
            threading.Thread(target=priority, args=(replicas[1].url, rid, vip)) for rid in vip_ids
        ]
        for thread in urgent:
            thread.start()
        for thread in [*urgent, *threads]:
            thread.join(timeout=60)
        assert vip == dict.fromkeys(vip_ids, "priority")
        seen = window(worker)
    finally:
        for replica in replicas:
            replica.stop()
    # The worker never ran more than its slots, nor queued (its own counters), and saw each
    # preempted request closed before it had answered anything.
    assert seen["peak_running"] <= SLOTS and seen["peak_waiting"] == 0
    spans = {span[0]: span for span in seen["spans"]}
    aborted = [rid for rid in flex_ids if spans.get(rid, [None] * 4)[3]]
    if on_preempt == "reject":
        assert sorted(flex.values(), key=str) == sorted([200] * 2 + ["preempted"] * 2, key=str)
        assert len(aborted) == PRIORITY
    else:
        assert list(flex.values()) == [200] * SLOTS  # served after all, from the head of flex
    # No priority request waited for a flex one to end: each began at the worker before
    # the flex requests that were not preempted ended.
    kept = [spans[rid] for rid in flex_ids if rid in spans and not spans[rid][3]]
    for rid in vip_ids:
        assert spans[rid][1] < min(span[2] for span in kept), (rid, spans)
    wait_for(lambda: not any(leftovers().values()), "Redis to hold nothing")
    records = records_for(config, {*flex_ids, *vip_ids})
    preempted = [r for rid in flex_ids for r in records[rid] if r["preempted"]]
    assert len(preempted) == PRIORITY
    assert all(r["completion_tokens"] == 0 and r["cost_usd"] == 0 for r in preempted)
    admissions = SLOTS + PRIORITY + (PRIORITY if on_preempt == "requeue" else 0)
    assert sum(len(found) for found in records.values()) == admissions


def test_a_deadline_the_queue_cannot_meet_is_a_429_and_a_bad_one_a_400(
    worker: procs.Proc, tmp_path: Path
) -> None:
    """Through a gateway: with every slot held, a priority request that may not preempt
    (default tier here) and says it waits 0.2 s is answered `deadline_unreachable` once its
    deadline passes, and leaves nothing queued; a header that is no number is a 400 naming
    it."""
    text = config_text(worker, "reject").replace(
        "tiers: [default, priority, flex]", "tiers: [default, flex]"
    )
    gateway = procs.gateway(tmp_path, text)
    flex: dict[str, Any] = {}
    threads = [
        threading.Thread(target=flex_stream, args=(gateway.url, f"dl-{i}-{time.time_ns()}", flex))
        for i in range(SLOTS)
    ]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: leases() == SLOTS, "the flex streams to hold every slot")
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            body = {"model": "pre", "prompt": "x", "max_tokens": 1}
            headers = {"authorization": f"Bearer {KEY}", "x-request-timeout": "0.2"}
            late = http.post("/v1/completions", json=body, headers=headers)
            assert late.status_code == 429
            assert late.json()["error"]["code"] == "deadline_unreachable"
            assert 1 <= int(late.headers["retry-after"]) <= 60
            assert leftovers()["queue"] == 0
            bad = http.post(
                "/v1/completions", json=body, headers={**headers, "x-request-timeout": "soon"}
            )
            assert bad.status_code == 400
            assert bad.json()["error"]["param"] == "x-request-timeout"
        for thread in threads:
            thread.join(timeout=60)
    finally:
        gateway.stop()
    assert list(flex.values()) == [200] * SLOTS
