"""Rate limits on the completion route in process (scripted upstream, memory:// store): every
answer to a limited key carries its x-ratelimit-* headers, 200s, streams and errors alike; a
429 says which limit; an answer that never reached admission charges nothing; a reload
changes an account's limits."""

from __future__ import annotations

import hashlib
from typing import Any

import fakeredis
import httpx
import pytest

from gateway.app.front import build_app
from gateway.runtime.settings import parse_config
from gateway.runtime.state import GatewayState
from tests.gateway.app.test_app import CONFIG, KEY, ScriptedUpstream, _settled

LIMITED = "sk-unit-limited"
TOKENS_ONLY = "sk-unit-tokens"
LIMITS = f"""
  - {{sha256: "{hashlib.sha256(LIMITED.encode()).hexdigest()}", account: lim, rpm: 3, tpm: 100000}}
  - {{sha256: "{hashlib.sha256(TOKENS_ONLY.encode()).hexdigest()}", account: tok}}
accounts:
  lim: {{rpm: 1000}}
  tok: {{tpm: 500}}
"""
REQUEST_HEADERS = ("limit-requests", "remaining-requests", "reset-requests")
TOKEN_HEADERS = ("limit-tokens", "remaining-tokens", "reset-tokens")


def make_app(extra_accounts: str = "") -> tuple[Any, ScriptedUpstream]:
    upstream = ScriptedUpstream()
    config = parse_config(CONFIG + LIMITS + extra_accounts, "unit.yaml")
    state = GatewayState(config, redis=fakeredis.FakeAsyncRedis(), upstream=upstream)  # type: ignore[arg-type]
    return build_app(state), upstream


async def post(app: Any, body: dict[str, Any], key: str = LIMITED) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        headers = {"authorization": f"Bearer {key}"}
        response = await client.post("/v1/completions", json=body, headers=headers)
    await _settled(app)
    return response


def limits_of(resp: httpx.Response) -> dict[str, str]:
    return {
        name.removeprefix("x-ratelimit-"): value
        for name, value in resp.headers.items()
        if name.startswith("x-ratelimit-")
    }


def rejections(app: Any, reason: str) -> float:
    labels = {"model": "m1", "tier": "default", "reason": reason}
    found = app.state.metrics.registry.get_sample_value("gateway_rejections_total", labels)
    return found or 0.0


async def test_answers_carry_the_headers_until_the_429_says_which_limit() -> None:
    app, _ = make_app()
    body = {"model": "m1", "prompt": "x", "max_tokens": 4}
    first = await post(app, body)
    assert first.status_code == 200
    seen = limits_of(first)
    assert set(seen) == {*REQUEST_HEADERS, *TOKEN_HEADERS}
    # The key's 3 rpm bind before the account's 1000; its reservation is 1 + 4 tokens.
    assert (seen["limit-requests"], seen["remaining-requests"]) == ("3", "2")
    assert (seen["limit-tokens"], seen["remaining-tokens"]) == ("100000", "99995")
    assert seen["reset-requests"] == "20s"
    stream = await post(app, {**body, "stream": True})
    assert stream.status_code == 200 and "[DONE]" in stream.text
    assert limits_of(stream)["remaining-requests"] == "1"
    await post(app, body)
    refused = await post(app, body)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_requests"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(refused.headers["retry-after"]) <= 20
    assert limits_of(refused)["remaining-requests"] == "0"
    assert rejections(app, "rate_limit_requests") == 1
    assert "x-ratelimit-limit-requests" not in (await post(app, body, key=KEY)).headers


async def test_the_release_trues_the_tokens_up_to_the_usage() -> None:
    app, _ = make_app()
    # Reserved: its prompt (1) and 400 asked; used: the worker's usage, 1 + 1.
    first = await post(app, {"model": "m1", "prompt": "x", "max_tokens": 400}, key=TOKENS_ONLY)
    assert limits_of(first)["remaining-tokens"] == "99"
    assert set(limits_of(first)) == set(TOKEN_HEADERS)
    again = await post(app, {"model": "m1", "prompt": "x", "max_tokens": 400}, key=TOKENS_ONLY)
    assert again.status_code == 200
    assert limits_of(again)["remaining-tokens"] == "97"  # 500 - 2 used - 401 reserved


async def test_each_of_n_answers_is_charged_its_tokens() -> None:
    app, _ = make_app()
    # Reserved: its prompt (1) and two answers of 200 each (n = 2), not one.
    body = {"model": "m1", "prompt": "x", "max_tokens": 200, "n": 2}
    first = await post(app, body, key=TOKENS_ONLY)
    assert first.status_code == 200
    assert limits_of(first)["remaining-tokens"] == "99"


async def test_a_request_larger_than_the_tokens_limit_is_told_it_never_fits() -> None:
    app, upstream = make_app()
    resp = await post(app, {"model": "m1", "prompt": "x", "max_tokens": 600}, key=TOKENS_ONLY)
    assert resp.status_code == 429
    assert resp.json()["error"]["code"] == "rate_limit_tokens"
    assert "can never be served" in resp.json()["error"]["message"]
    assert resp.headers["x-should-retry"] == "false"
    assert limits_of(resp)["remaining-tokens"] == "500"
    assert upstream.sent == []


@pytest.mark.parametrize(
    ("body", "status"),
    [({"model": "nope", "prompt": "x"}, 404), ({"model": "m1", "prompt": 5}, 422)],
)
async def test_an_answer_before_admission_carries_the_headers_and_charges_nothing(
    body: dict[str, Any], status: int
) -> None:
    app, _ = make_app()
    resp = await post(app, body)
    assert resp.status_code == status
    assert limits_of(resp) == {
        "limit-requests": "3", "remaining-requests": "3", "reset-requests": "0s",
        "limit-tokens": "100000", "remaining-tokens": "100000", "reset-tokens": "0s",
    }  # fmt: skip


async def test_a_request_too_large_for_every_budget_carries_the_headers_too() -> None:
    # A walk that never asked the buckets (its only model holds 100 tokens at most): its
    # 400 context_too_large reads them, as an answer before admission does, not the limits
    # alone (those are for a Redis that does not answer).
    upstream = ScriptedUpstream()
    budgeted = CONFIG.replace(
        "max_concurrency: 2}]", "max_concurrency: 2, max_tokens_in_flight: 100}]", 1
    )
    config = parse_config(budgeted + LIMITS, "unit.yaml")
    state = GatewayState(config, redis=fakeredis.FakeAsyncRedis(), upstream=upstream)  # type: ignore[arg-type]
    resp = await post(build_app(state), {"model": "m1", "prompt": "x", "max_tokens": 500})
    assert (resp.status_code, resp.json()["error"]["code"]) == (400, "context_too_large")
    assert limits_of(resp) == {
        "limit-requests": "3", "remaining-requests": "3", "reset-requests": "0s",
        "limit-tokens": "100000", "remaining-tokens": "100000", "reset-tokens": "0s",
    }  # fmt: skip


@pytest.mark.slow
async def test_a_reload_changes_an_accounts_limits() -> None:
    app, _ = make_app()
    body = {"model": "m1", "prompt": "x", "max_tokens": 1}
    assert limits_of(await post(app, body, key=KEY)) == {}
    await app.state.apply(parse_config(CONFIG + LIMITS + "  unit: {rpm: 7}\n", "unit.yaml"))
    try:
        assert limits_of(await post(app, body, key=KEY))["limit-requests"] == "7"
    finally:
        await app.state.close()
