"""Billing from outside: one usage record per admitted request, the metrics that agree with
what was sent, and no record lost while Redis is away; on a single Redis and on a 3-master
Redis Cluster (where the master of the stream `usage` is the one killed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import uuid
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
from tests.redis_cluster import RedisCluster, start_cluster
from tests.redis_server import RedisServer, free_port

KEY = "sk-usage"
# Request ids are remembered by Redis for a week against duplicates: each run uses its own.
RUN = uuid.uuid4().hex[:8]
ID = {name: f"bill-{RUN}-{name}" for name in
      ("chat", "priority", "flex", "stream", "held", "rejected", "fallback", "broken")}  # fmt: skip
AUTH = {"Authorization": f"Bearer {KEY}"}
PRICE = {"cheap": (0.5, 1.0), "busy": (2.0, 4.0), "broken": (1.0, 1.0), "slow": (1.0, 2.0)}
MULTIPLIER = {"priority": 1.5, "default": 1.0, "flex": 0.5}


@dataclass
class Billing:
    gateway: procs.Proc
    config: Path
    tmp: Path


def billing_config(good: procs.Proc, slow: procs.Proc, broken: procs.Proc, redis_url: str,
                   tmp: Path, on_outage: str = "reject") -> str:  # fmt: skip
    def model(name: str, worker: procs.Proc, size: int) -> str:
        inp, out = PRICE[name]
        return (
            f"  {name}:\n    tiers: [default, priority, flex]\n"
            f"    price: {{input_per_mtok: {inp}, output_per_mtok: {out}}}\n"
            f'    endpoints: [{{url: "{worker.url}", max_concurrency: {size}, model: m1}}]\n'
        )

    return (
        f'redis: {{url: "{redis_url}", lease_ttl_s: 5, on_outage: {on_outage}}}\n'
        f'usage: {{spool_dir: "{tmp}/spool-{free_port()}"}}\n'
        "models:\n"
        + model("cheap", good, 8)
        + model("busy", slow, 1)
        + model("slow", slow, 4)
        + model("broken", broken, 2)
        + f'keys: [{{sha256: "{digest(KEY)}", account: billing}}]\n'
    )


# On a single Redis and on a 3-master Redis Cluster: the fallback (busy -> cheap) and the
# usage record cross masters there, the account on another master than the model served.
@pytest.fixture(scope="module", params=["single", "cluster"])
def billing(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Billing]:
    redis_url = REDIS_URL
    if request.param == "cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        nodes = {n: cluster.node_of("{" + n + "}").port for n in ("cheap", "busy", "broken")}
        assert len(set(nodes.values())) == 3, nodes
        assert cluster.node_of("{billing}").port != nodes["cheap"]
        redis_url = cluster.url
    tmp = tmp_path_factory.mktemp("billing")
    started: list[procs.Proc] = []
    try:
        good = procs.sim(tmp, "--ttft-ms", "0", "--itl-ms", "1", "--tokens", "8")
        slow = procs.sim(tmp, "--ttft-ms", "0", "--itl-ms", "50", "--tokens", "60")
        broken = procs.sim(tmp, "--fault", "error500")
        started += [good, slow, broken]
        text = billing_config(good, slow, broken, redis_url, tmp)
        gateway = procs.gateway(tmp, text)
        started.append(gateway)
        yield Billing(gateway, tmp / f"gateway-{gateway.port}.yaml", tmp)
    finally:
        for proc in started:
            proc.stop()


def export(config: Path, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "usage", "export", "--config", str(config), *args],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def records_for(config: Path, rids: set[str]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {rid: [] for rid in rids}
    for record in export(config):
        if record["request_id"] in found:
            found[record["request_id"]].append(record)
    return found


def metric(url: str, sample: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for(check: Any, what: str, limit_s: float = 10.0) -> None:
    """Another process's state has no event to wait on: poll it, bounded in time."""
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def expected_cost(model: str, tier: str, prompt: int, completion: int) -> float:
    inp, out = PRICE[model]
    return round((prompt * inp + completion * out) / 1e6 * MULTIPLIER[tier], 9)


def test_a_mixed_run_is_billed_exactly_once_per_admitted_request(
    billing: Billing, sdk: Sdk
) -> None:
    url = billing.gateway.url
    client = sdk(url + "/v1", KEY)

    def rid(name: str) -> dict[str, str]:
        return {"x-request-id": ID[name], "x-deepinfra-source": "e2e-" + "s" * 100}

    answers: dict[str, tuple[str, str, int, int]] = {}  # rid -> model, tier, prompt, completion
    chat = client.chat.completions.with_raw_response.create(
        model="cheap", messages=[{"role": "user", "content": "a b c"}], extra_headers=rid("chat"),
        user="u" * 300,
    ).parse()  # fmt: skip
    assert chat.usage is not None
    answers[ID["chat"]] = (
        "cheap",
        "default",
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    for tier in ("priority", "flex"):
        out = client.completions.create(
            model="cheap", prompt="x y", max_tokens=3, extra_body={"service_tier": tier},
            extra_headers=rid(tier),
        )  # fmt: skip
        assert out.usage is not None
        answers[ID[tier]] = (
            "cheap",
            tier,
            out.usage.prompt_tokens,
            out.usage.completion_tokens,
        )
    stream = client.completions.create(
        model="cheap", prompt="x", stream=True, extra_headers=rid("stream"),
        stream_options={"include_usage": False},
    )  # fmt: skip
    assert [c for c in stream if c.usage is not None] == []  # hidden from the caller...
    answers[ID["stream"]] = ("cheap", "default", 1, 8)  # ...but billed from the worker's

    # Hold busy's only slot: a fail-fast request is rejected (no record), a fallback is served.
    held = client.completions.create(
        model="busy", prompt="x", stream=True, extra_headers=rid("held")
    )
    next(iter(held))
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="busy", prompt="x", extra_body={"fail_fast": True},
                                  extra_headers=rid("rejected"))  # fmt: skip
    fallback = client.completions.create(
        model="busy", prompt="x", max_tokens=2, extra_body={"models": ["busy", "cheap"]},
        extra_headers=rid("fallback"),
    )  # fmt: skip
    assert fallback.model == "cheap" and fallback.usage is not None
    answers[ID["fallback"]] = ("cheap", "default", 1, 2)
    held.close()  # a client that goes away mid-stream: cancelled, billed for what it got

    with pytest.raises(openai.APIStatusError) as failed:
        client.completions.create(model="broken", prompt="x", extra_headers=rid("broken"))
    assert failed.value.status_code == 502

    rids = {*answers, ID["held"], ID["broken"], ID["rejected"]}
    wait_for(lambda: len(records_for(billing.config, {ID["held"]})[ID["held"]]) == 1,
             "the cancelled stream's record")  # fmt: skip
    found = records_for(billing.config, rids)
    assert found.pop(ID["rejected"]) == []
    assert {r: len(v) for r, v in found.items()} == dict.fromkeys(found, 1)

    for request_id, (model, tier, prompt, completion) in answers.items():
        record = found[request_id][0]
        assert (record["served_model"], record["tier"]) == (model, tier), request_id
        assert (record["prompt_tokens"], record["completion_tokens"]) == (prompt, completion)
        assert record["cost_usd"] == pytest.approx(expected_cost(model, tier, prompt, completion))
        assert record["outcome"] == "complete" and record["status"] == 200
        assert record["account"] == "billing" and record["key_id"] == digest(KEY)[:12]
        assert record["source"] == ("e2e-" + "s" * 100)[:64]
    assert found[ID["chat"]][0]["user"] == "u" * 256
    assert found[ID["fallback"]][0]["requested_model"] == "busy"
    assert found[ID["fallback"]][0]["fallback_index"] == 1
    assert found[ID["priority"]][0]["requested_tier"] == "priority"
    held_record = found[ID["held"]][0]
    assert held_record["outcome"] == "cancelled" and held_record["served_model"] == "busy"
    assert held_record["completion_tokens"] >= 1 and held_record["estimated"] is True
    broken_record = found[ID["broken"]][0]
    assert broken_record["outcome"] == "error" and broken_record["status"] == 502

    # The metrics agree with what was sent.
    assert (
        metric(url, 'gateway_rejections_total{model="busy",reason="model_busy",tier="default"}')
        == 1
    )
    assert metric(url, 'gateway_fallbacks_total{from_model="busy",to_model="cheap"}') == 1
    chat_tokens = answers[ID["chat"]][3] + answers[ID["stream"]][3] + answers[ID["fallback"]][3]
    assert (
        metric(url, 'gateway_tokens_total{kind="completion",model="cheap",tier="default"}')
        == chat_tokens
    )
    assert metric(url, 'gateway_requests_total{code="200",model="cheap",tier="priority"}') == 1
    assert metric(url, 'gateway_requests_total{code="502",model="broken",tier="default"}') == 1

    # Summaries for finance.
    totals = export(billing.config, "--by", "account,tier,model")
    mine = [t for t in totals if t["account"] == "billing" and t["model"] == "cheap"]
    assert sum(t["requests"] for t in mine) >= 5


def test_queue_depth_rises_while_waiting_and_returns_to_zero(billing: Billing) -> None:
    url = billing.gateway.url
    depth = 'gateway_queue_depth{model="busy",tier="default"}'
    body = {"model": "busy", "prompt": "x", "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=30) as held:
        chunks = held.iter_bytes()
        next(chunks)
        waiter = threading.Thread(target=lambda: httpx.post(
            url + "/v1/completions", json={"model": "busy", "prompt": "x", "max_tokens": 1},
            headers=AUTH, timeout=30))  # fmt: skip
        waiter.start()
        wait_for(lambda: metric(url, depth) == 1.0, "the queue depth to show the waiter")
    waiter.join(timeout=30)
    wait_for(lambda: metric(url, depth) == 0.0, "the queue depth to return to 0")


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
@pytest.mark.parametrize("kind", ["single", "cluster"])
def test_killing_redis_loses_no_usage_record(tmp_path: Path, kind: str) -> None:
    tmp = tmp_path
    servers: list[RedisServer] = []
    started: list[procs.Proc] = []
    try:
        server, redis_url = usage_store(tmp, kind, servers)
        good = procs.sim(tmp, "--ttft-ms", "0", "--itl-ms", "20", "--tokens", "5")
        started.append(good)
        text = billing_config(good, good, good, redis_url, tmp, "local")
        gateway = procs.gateway(tmp, text)
        started.append(gateway)
        served: list[str] = []
        for i in range(60):
            if i == 15:
                server.kill()
            if i == 30:
                server.start()
            rid = f"outage-{RUN}-{i}"
            headers = {**AUTH, "x-request-id": rid}
            r = httpx.post(gateway.url + "/v1/completions", headers=headers, timeout=30,
                           json={"model": "cheap", "prompt": "x", "max_tokens": 2})  # fmt: skip
            if r.status_code == 200:
                served.append(rid)
        assert len(served) >= 45  # traffic went on through the outage (on_outage: local)
        config = tmp / f"gateway-{gateway.port}.yaml"
        wait_for(lambda: all(len(v) == 1 for v in records_for(config, set(served)).values()),
                 "every admitted request's record", 20)  # fmt: skip
    finally:
        for proc in started:
            proc.stop()
        for stopped in servers:
            stopped.stop()


def usage_store(tmp: Path, kind: str, servers: list[RedisServer]) -> tuple[RedisServer, str]:
    """The server to kill (with an append-only file, as in production) and the address the
    gateway is given: a single Redis, or a Cluster's master of the stream `usage` and
    another master's address. Every server started is added to `servers`."""
    if kind == "single":
        servers.append(RedisServer(tmp, persistent=True).start())
        return servers[0], servers[0].url
    # No node is marked failed within the test (node timeout 60 s): the others go on.
    extra = ["--appendonly", "yes", "--appendfsync", "no", "--cluster-node-timeout", "60000"]
    cluster = start_cluster(tmp / "cluster", extra)
    servers += cluster.nodes
    down = cluster.node_of("usage")
    assert cluster.node_of("{billing}").port != down.port
    return down, next(
        u for n, u in zip(cluster.nodes, cluster.urls(), strict=True) if n is not down
    )
