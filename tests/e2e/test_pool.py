"""Inside the pool, from outside: affinity, failover, aborts, mid-stream deaths, SIGTERM."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import REDIS_URL
from tests.e2e import procs
from tests.e2e.conftest import Sdk, digest

KEY = "sk-pool"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Pool:
    gateway: procs.Proc
    a: procs.Proc
    b: procs.Proc
    fragile: procs.Proc
    config: str
    tmp: Path


def pool_config(a: procs.Proc, b: procs.Proc, fragile: procs.Proc) -> str:
    return f"""
redis: {{url: "{REDIS_URL}", lease_ttl_s: 5}}
health: {{interval_s: 0.2, timeout_s: 0.5, ejection_s: 0.5, unhealthy_after: 1}}
shutdown_grace_s: 20
models:
  pool:
    endpoints:
      - {{url: "{a.url}", max_concurrency: 4, model: m1}}
      - {{url: "{b.url}", max_concurrency: 4, model: m1}}
  one:
    tiers: [default, priority]
    worker_priority: true
    endpoints: [{{url: "{a.url}", max_concurrency: 1, model: m1}}]
  fragile:
    endpoints: [{{url: "{fragile.url}", max_concurrency: 4, model: m1}}]
keys: [{{sha256: "{digest(KEY)}", account: pool}}]
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("pool")
    started: list[procs.Proc] = []
    try:
        # 40 tokens at 50 ms: a stream lasts 2 s, long enough to act while it flows.
        timing = ("--ttft-ms", "0", "--itl-ms", "50", "--tokens", "40")
        a, b, fragile = (procs.sim(tmp, *timing) for _ in range(3))
        started += [a, b, fragile]
        config = pool_config(a, b, fragile)
        gateway = procs.gateway(tmp, config)
        started.append(gateway)
        yield Pool(gateway, a, b, fragile, config, tmp)
    finally:
        for proc in started:
            proc.stop()


def post(pool: Pool, **body: Any) -> httpx.Response:
    payload = {"prompt": "x", "max_tokens": 1, **body}
    return httpx.post(pool.gateway.url + "/v1/completions", json=payload, headers=AUTH, timeout=30)


def seen_by(worker: procs.Proc, prefix: str) -> int:
    requests = httpx.get(worker.url + "/sim/requests", timeout=5).json()["requests"]
    return sum(1 for r in requests if r["headers"].get("x-request-id", "").startswith(prefix))


def metric(url: str, line_start: str) -> float | None:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_for(check: Any, what: str, limit_s: float = 10.0) -> None:
    """Another process's state has no event to wait on: poll it, bounded in time."""
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def both_up(pool: Pool) -> bool:
    """Both of pool's endpoints in rotation (a probe that timed out on a busy machine takes
    one out for `ejection_s`)."""
    text = httpx.get(pool.gateway.url + "/metrics", timeout=5).text
    return (
        sum(
            1
            for line in text.splitlines()
            if line.startswith("gateway_endpoint_up{")
            and 'model="pool"' in line
            and line.endswith(" 1.0")
        )
        == 2
    )


def test_a_cache_key_sticks_to_one_worker_and_no_key_spreads(pool: Pool) -> None:
    wait_for(lambda: both_up(pool), "both endpoints in rotation")
    for i in range(10):
        headers = {**AUTH, "x-request-id": f"aff-key-{i}"}
        body = {"model": "pool", "prompt": "x", "max_tokens": 1, "prompt_cache_key": "conv-42"}
        r = httpx.post(pool.gateway.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 200
    counts = sorted([seen_by(pool.a, "aff-key-"), seen_by(pool.b, "aff-key-")])
    assert counts == [0, 10]
    # Without a key the least loaded takes it, equal loads in turn: both serve some. In
    # rounds of 10 (at most 4), each once both are in rotation again: a probe that times out
    # on a busy machine takes one out for a moment, and its requests go to the other.
    for i in range(40):
        if i % 10 == 0:
            if seen_by(pool.a, "aff-none-") and seen_by(pool.b, "aff-none-"):
                break
            wait_for(lambda: both_up(pool), "both endpoints in rotation")
        headers = {**AUTH, "x-request-id": f"aff-none-{i}"}
        body = {"model": "pool", "prompt": "x", "max_tokens": 1}
        assert (
            httpx.post(pool.gateway.url + "/v1/completions", json=body, headers=headers).status_code
            == 200
        )
    assert seen_by(pool.a, "aff-none-") > 0 and seen_by(pool.b, "aff-none-") > 0


def test_worker_priority_passes_the_tier_on(pool: Pool) -> None:
    headers = {**AUTH, "x-request-id": "prio-1"}
    body = {"model": "one", "prompt": "x", "max_tokens": 1, "service_tier": "priority"}
    assert (
        httpx.post(pool.gateway.url + "/v1/completions", json=body, headers=headers).status_code
        == 200
    )
    requests = httpx.get(pool.a.url + "/sim/requests").json()["requests"]
    sent = next(r["body"] for r in requests if r["headers"].get("x-request-id") == "prio-1")
    assert sent["priority"] == -1


def test_a_dropped_stream_aborts_the_worker_and_frees_the_slot(pool: Pool, sdk: Sdk) -> None:
    client = sdk(pool.gateway.url + "/v1", KEY)
    aborted = 'vllm:request_success_total{finished_reason="abort",model_name="m1"}'
    before = metric(pool.a.url, aborted) or 0.0
    stream = client.completions.create(model="one", prompt="x", stream=True)
    next(iter(stream))
    stream.close()
    wait_for(
        lambda: (metric(pool.a.url, aborted) or 0.0) > before, "the worker to count an abort", 5
    )
    # "one" has a single slot: a fail-fast request gets it, so it was given back.
    wait_for(lambda: post(pool, model="one", fail_fast=True).status_code == 200, "the slot", 5)


def test_a_worker_dying_mid_stream_ends_the_stream_with_an_error(pool: Pool, sdk: Sdk) -> None:
    httpx.post(pool.fragile.url + "/sim/fault", json={"fault": "die_mid_stream"})
    try:
        client = sdk(pool.gateway.url + "/v1", KEY)
        stream = client.completions.create(model="fragile", prompt="x", stream=True)
        received = []
        with pytest.raises(openai.APIError) as err:
            for chunk in stream:
                received.append(chunk)
        assert received, "some tokens came before the failure"
        assert "broke off" in str(err.value) or "ended" in str(err.value)
    finally:
        httpx.post(pool.fragile.url + "/sim/fault", json={"fault": None})
    assert post(pool, model="fragile").status_code == 200  # nothing left stuck


def test_a_killed_worker_is_failed_over_and_comes_back(pool: Pool) -> None:
    capacity = 'gateway_capacity{model="pool"}'
    assert metric(pool.gateway.url, capacity) == 8.0
    statuses = [post(pool, model="pool").status_code for _ in range(10)]
    pool.b.stop(signal.SIGKILL)
    statuses += [post(pool, model="pool").status_code for _ in range(30)]
    failures = [s for s in statuses if s != 200]
    assert len(failures) <= 1, statuses
    wait_for(lambda: metric(pool.gateway.url, capacity) == 4.0, "the dead worker to leave")
    ready = httpx.get(pool.gateway.url + "/readyz")
    assert ready.status_code == 200  # the model still has a healthy endpoint
    pool.b.start()
    wait_for(lambda: metric(pool.gateway.url, capacity) == 8.0, "the worker to come back")


def test_sigterm_lets_a_long_stream_finish_then_exits_0(pool: Pool) -> None:
    gateway = procs.gateway(pool.tmp, pool.config)
    try:
        body = {"model": "pool", "prompt": "x", "stream": True}
        with httpx.stream(
            "POST", gateway.url + "/v1/completions", json=body, headers=AUTH, timeout=30
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert gateway.popen is not None
            gateway.popen.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert "data: [DONE]" in rest
        assert gateway.popen.wait(timeout=20) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(gateway.url + "/healthz", timeout=2)
    finally:
        gateway.stop(signal.SIGKILL)
