"""Token budgets against real simulated workers (`gateway sim --kv-tokens`): `auto` reads the
worker's KV cache (num_gpu_blocks x block_size); an adaptive budget shrinks while the worker
has requests waiting, never below min_fraction, and grows back once it is idle (Health on a
fake clock, its rounds run by the test); and a real gateway shows the budget in its metrics
and writes it into Redis's endpoint index."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from gateway.runtime.settings import parse_config
from routing.hop.budgets import HOLD_S
from routing.hop.health import Health, HealthSettings
from routing.registry import Registry
from tests.conftest import REDIS_URL
from tests.e2e import procs
from tests.e2e.conftest import digest

# 12 blocks of 16 tokens: 192. A request of a 2-word prompt and 50 tokens needs 52: three
# run, the rest wait (the worker's own queue, `vllm:num_requests_waiting`).
KV_TOKENS, BLOCK, KV_BUDGET = 200, 16, 192
HOLDING = ("--kv-tokens", str(KV_TOKENS), "--block-size", str(BLOCK), "--tokens", "50")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[procs.Proc]:
    # Requests hold their KV cache for a minute: they end when the test drops them.
    sim = procs.sim(tmp_path_factory.mktemp("budgets"), *HOLDING, "--ttft-ms", "60000")
    try:
        yield sim
    finally:
        sim.stop()


def sim_gauge(http: httpx.Client, url: str, name: str) -> float:
    for family in text_string_to_metric_families(http.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in the worker's /metrics")


def wait_for(check: Callable[[], bool], what: str, limit_s: float = 15.0) -> None:
    """Another process's state has no event to wait on: poll it, bounded in time."""
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


async def test_an_adaptive_auto_budget_shrinks_while_the_worker_queues_and_grows_back(
    worker: procs.Proc,
) -> None:
    url = worker.url
    config = parse_config(
        f"""
models:
  m1:
    adaptive: {{enabled: true, min_fraction: 0.5, waiting_threshold: 1}}
    endpoints: [{{url: "{url}", max_concurrency: 8, max_tokens_in_flight: auto}}]
""",
        "t.yaml",
    )
    clock, told = Clock(), asyncio.Event()
    changes: list[set[str]] = []

    def changed(urls: set[str]) -> None:
        changes.append(urls)
        told.set()

    # Its own loop probes once at start (and not again for 300 s); the test runs the rest.
    health = Health(Registry(config.models), HealthSettings(interval_s=300), changed, clock=clock)
    await health.start()
    flood: list[asyncio.Task[httpx.Response]] = []
    try:
        await asyncio.wait_for(told.wait(), 15)
        assert changes == [{url}] and health.budget("m1", url) == KV_BUDGET

        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": "m1", "prompt": "hello there", "max_tokens": 50}
            flood = [
                asyncio.create_task(client.post(url + "/v1/completions", json=body))
                for _ in range(6)
            ]
            with httpx.Client(timeout=5) as http:
                waiting = "vllm:num_requests_waiting"
                await asyncio.to_thread(
                    wait_for, lambda: sim_gauge(http, url, waiting) >= 1, "requests to wait"
                )
                shrunk = [await probe_round(health, clock, HOLD_S, url) for _ in range(4)]
                assert shrunk == [144, 108, 96, 96]  # x0.75 a hold, floored at 0.5 x 192

                for task in flood:  # the callers go away: the worker drops their requests
                    task.cancel()
                await asyncio.gather(*flood, return_exceptions=True)
                await asyncio.to_thread(
                    wait_for, lambda: sim_gauge(http, url, waiting) == 0, "an idle worker"
                )
        grown = [await probe_round(health, clock, 5.0, url) for _ in range(10)]
        assert grown == sorted(grown) and grown[0] > 96 and grown[-1] == KV_BUDGET
    finally:
        for task in flood:
            task.cancel()
        await health.close()


async def probe_round(health: Health, clock: Clock, after_s: float, url: str) -> int:
    clock.now += after_s
    await health.probe_all()
    budget = health.budget("m1", url)
    assert budget is not None
    return budget


def test_a_gateway_reads_an_auto_budget_shows_it_and_writes_it_to_redis(
    tmp_path: Path,
) -> None:
    sim = procs.sim(tmp_path, "--kv-tokens", "1000", "--block-size", "16")
    model, expected = "budget-auto", (1000 // 16) * 16
    store = redis.Redis.from_url(REDIS_URL)
    gateway = None
    try:
        gateway = procs.gateway(
            tmp_path,
            f"""
redis: {{url: "{REDIS_URL}"}}
health: {{interval_s: 0.2}}
models:
  {model}:
    endpoints: [{{url: "{sim.url}", max_concurrency: 4, model: m1, max_tokens_in_flight: auto}}]
""",
        )
        with httpx.Client(timeout=5) as http:
            shown = lambda: gateway_budget(http, gateway.url, model, sim.url) == expected  # noqa: E731
            wait_for(shown, "gateway_token_budget")
        key = "gw:v2:{" + model + "}:eps"

        def spec() -> str:
            return cast(bytes, store.hget(key, sim.url) or b"").decode()

        wait_for(lambda: spec().endswith(f" {expected}"), "the budget in the index")
        # size, penalty, budget and whole budget (unadapted: the same here)
        assert spec().split() == ["4", "0.0", str(expected), str(expected)]
    finally:
        if gateway is not None:
            gateway.stop()
        sim.stop()
        if keys := store.keys("gw:v2:{" + model + "}:*"):
            store.delete(*keys)
        store.close()


def gateway_budget(http: httpx.Client, gateway: str, model: str, endpoint: str) -> float | None:
    for family in text_string_to_metric_families(http.get(gateway + "/metrics").text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "gateway_token_budget" and labels == {
                "model": model,
                "endpoint": endpoint,
            }:
                return sample.value
    return None


def test_a_worker_restarted_with_a_smaller_cache_is_never_given_more_than_it_holds(
    tmp_path: Path,
) -> None:
    """An `auto` budget that shrinks because the worker came back with a smaller cache is
    the whole budget now: a request larger than it is refused (400 context_too_large,
    naming it), never sent alone to a worker that cannot hold it."""
    sim = procs.sim(tmp_path, "--kv-tokens", "1000", "--block-size", "16", "--tokens", "50")
    model, key = "budget-restart", "sk-budget-restart"
    store = redis.Redis.from_url(REDIS_URL)
    gateway = None
    try:
        gateway = procs.gateway(
            tmp_path,
            f"""
redis: {{url: "{REDIS_URL}"}}
health: {{interval_s: 0.2}}
keys: [{{sha256: "{digest(key)}", account: budget-restart}}]
models:
  {model}:
    max_tokens_default: 1000
    endpoints: [{{url: "{sim.url}", max_concurrency: 4, model: m1, max_tokens_in_flight: auto}}]
""",
        )
        with httpx.Client(timeout=30) as http:

            def budget() -> float | None:
                return gateway_budget(http, gateway.url, model, sim.url)

            wait_for(lambda: budget() == 992, "the first cache's budget")
            sim.stop()
            small = ["sim", "--port", str(sim.port), "--models", "m1", "--kv-tokens", "200"]
            small += ["--block-size", "16", "--tokens", "50"]
            sim = procs.Proc(small, sim.port, "/health", tmp_path / "sim-small.log").start()
            wait_for(lambda: budget() == 192, "the smaller cache's budget")
            wait_for(lambda: gateway_up(http, gateway.url, model, sim.url), "back in rotation")
            body = {"model": model, "prompt": "hello there", "max_tokens": 500}
            answer = http.post(
                gateway.url + "/v1/completions", json=body,
                headers={"authorization": f"Bearer {key}"},
            )  # fmt: skip
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "context_too_large"
        assert "192 tokens" in answer.json()["error"]["message"]
    finally:
        if gateway is not None:
            gateway.stop()
        sim.stop()
        if keys := store.keys("gw:v2:{" + model + "}:*"):
            store.delete(*keys)
        store.close()


def gateway_up(http: httpx.Client, gateway: str, model: str, endpoint: str) -> bool:
    for family in text_string_to_metric_families(http.get(gateway + "/metrics").text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "gateway_endpoint_up" and labels == {
                "model": model,
                "endpoint": endpoint,
            }:
                return sample.value == 1
    return False


def test_a_tier_never_reserves_more_than_its_share_of_a_budget(tmp_path: Path) -> None:
    """docs/api.md: a tier fills at most its `max_utilization` of an endpoint's token budget,
    alone on an idle endpoint too; a request larger than its tier's share is refused before
    it queues (400 context_too_large, naming the tier's share), where the same request of a
    tier with the whole budget runs (issue 41: a lone flex request of 2,000 tokens took the
    whole budget of 2,000; default at 0.5 took 1,900)."""
    import openai

    sim = procs.sim(tmp_path, "--tokens", "2")
    model, key = "tier-share", "sk-tier-share"
    store = redis.Redis.from_url(REDIS_URL)
    gateway = None
    try:
        gateway = procs.gateway(
            tmp_path,
            f"""
redis: {{url: "{REDIS_URL}"}}
tiers: {{default: {{max_utilization: 0.5}}}}
keys: [{{sha256: "{digest(key)}", account: tier-share}}]
models:
  {model}:
    max_tokens_default: 4000
    tiers: [default, priority, flex]
    endpoints: [{{url: "{sim.url}", max_concurrency: 4, model: m1, max_tokens_in_flight: 2000}}]
""",
        )
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)

        def ask(tier: str, tokens: int) -> int | str:
            # A prompt of 4 token ids counts 4: the reservation is exactly `tokens`.
            try:
                client.completions.create(
                    model=model, prompt=[1, 2, 3, 4], max_tokens=tokens - 4,
                    extra_body={"service_tier": tier},
                )  # fmt: skip
            except openai.BadRequestError as exc:
                body = exc.body if isinstance(exc.body, dict) else {}
                return f"{body.get('code')}: {body.get('message')}"
            return 200

        assert ask("priority", 2000) == 200  # its ceiling is the whole budget
        for tier, most in (("flex", 1600), ("default", 1000)):
            refused = ask(tier, most + 1)
            assert isinstance(refused, str) and refused.startswith("context_too_large"), refused
            assert f"for the {tier} tier ({most} tokens" in refused, refused
            assert ask(tier, 2000) != 200
            assert ask(tier, most) == 200  # exactly its share fits
    finally:
        if gateway is not None:
            gateway.stop()
        sim.stop()
        if keys := store.keys("gw:v2:{" + model + "}:*"):
            store.delete(*keys)
        store.close()
