"""Token budgets reach admission and the gauge `gateway_token_budget`: the configured ones
at start, `auto` once read, an adaptive one as it moves, per (model, endpoint); Redis's
index is written only the endpoints whose budget changed."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from gateway.runtime.settings import GatewayConfig, parse_config
from gateway.runtime.state import GatewayState
from routing.hop.scrape import Reading

# Nothing listens on these: probes fail, and `unhealthy_after` keeps them in rotation.
W1, W2, W3 = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"


def config(n_budget: str = ", max_tokens_in_flight: 500") -> GatewayConfig:
    return parse_config(
        f"""
redis: {{url: "memory://"}}
health: {{interval_s: 300, unhealthy_after: 100}}
models:
  m:
    adaptive: {{enabled: true, min_fraction: 0.5}}
    endpoints:
      - {{url: "{W1}", max_concurrency: 2, max_tokens_in_flight: 1000}}
      - {{url: "{W2}", max_concurrency: 2, max_tokens_in_flight: auto}}
      - {{url: "{W3}", max_concurrency: 2}}
  n: {{endpoints: [{{url: "{W1}", max_concurrency: 2{n_budget}}}]}}
""",
        "t.yaml",
    )


def written(state: GatewayState, model: str) -> dict[str, int] | None:
    """The endpoints' budgets the next index write of `model` sends (0: none); None: no write."""
    call = state.admission.slots[model].index()
    if call is None:
        return None
    args: Sequence[Any] = call[2]
    n = args[4]  # then per endpoint: url, max_concurrency, penalty, budget, whole budget
    return {args[5 + 5 * i]: args[5 + 5 * i + 3] for i in range(n)}


def gauge(state: GatewayState, model: str, url: str) -> float | None:
    labels = {"model": model, "endpoint": url}
    return state.metrics.registry.get_sample_value("gateway_token_budget", labels)


@pytest.fixture
async def state() -> AsyncIterator[GatewayState]:
    state = GatewayState(config())
    yield state
    await asyncio.wait_for(state.close(), 10)


async def test_budgets_reach_admission_per_model_and_endpoint(state: GatewayState) -> None:
    assert written(state, "m") == {W1: 1000, W2: 0, W3: 0}  # auto: none until read
    assert written(state, "n") == {W1: 500}
    assert gauge(state, "m", W1) == 1000 and gauge(state, "n", W1) == 500
    assert math.isnan(gauge(state, "m", W2) or 0.0)
    assert gauge(state, "m", W3) is None  # no budget, no series

    state.health.probed(W2, ok=True, reading=Reading(waiting=0.0, kv_tokens=800))
    assert written(state, "m") == {W2: 800}  # only what changed
    assert written(state, "n") is None
    assert gauge(state, "m", W2) == 800

    state.health.probed(W1, ok=True, reading=Reading(waiting=3.0, kv_usage=0.5))
    assert written(state, "m") == {W1: 750}  # m adapts: down by a quarter
    assert written(state, "n") is None  # n, on the same worker, does not
    assert gauge(state, "m", W1) == 750 and gauge(state, "n", W1) == 500


async def test_a_budget_a_reload_removes_is_no_longer_shown(state: GatewayState) -> None:
    await state.apply(config(n_budget=""))
    assert math.isnan(gauge(state, "n", W1) or 0.0)
    assert gauge(state, "m", W1) == 1000


async def test_an_endpoint_the_keeper_no_longer_reads_loses_its_reserved_series(
    state: GatewayState,
) -> None:
    """`gateway_tokens_reserved` follows the keeper's reads: an endpoint it dropped (gone
    from the config, nothing reserved there: tests/routing/admission/test_keeper.py) has no series,
    not a 0 kept forever."""

    def reserved(model: str, url: str) -> float | None:
        labels = {"model": model, "endpoint": url}
        return state.metrics.registry.get_sample_value("gateway_tokens_reserved", labels)

    state.keeper.reserved.update({("m", W1): 300, ("m", W2): 0})
    state.render_metrics()
    assert reserved("m", W1) == 300 and reserved("m", W2) == 0
    del state.keeper.reserved["m", W2]
    state.render_metrics()
    assert reserved("m", W2) is None and reserved("m", W1) == 300
