"""What reaches the worker, what comes back, and the operator routes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import KEY, KEY_LIMITED, Fleet

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def http(fleet: Fleet) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fleet.gateway.url, headers=AUTH, timeout=10) as client:
        yield client


def _last_request(fleet: Fleet, rid: str) -> dict[str, Any]:
    for sim in fleet.fast:
        for req in httpx.get(sim.url + "/sim/requests", timeout=5).json()["requests"]:
            if req["headers"].get("x-request-id") == rid:
                return dict(req)
    raise AssertionError(f"no worker saw request {rid}")


def test_worker_sees_the_rewritten_body(fleet: Fleet, http: httpx.Client) -> None:
    body = {
        "model": "ignored",
        "models": ["m2"],
        "fail_fast": True,
        "service_tier": "priority",
        "prompt": "hi",
        "max_tokens": 2,
        "some_worker_flag": {"kept": [1, 2]},
    }
    resp = http.post("/v1/completions", json=body, headers={"x-request-id": "rid-forward-1"})
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "rid-forward-1"
    seen = _last_request(fleet, "rid-forward-1")
    assert seen["body"]["model"] == "m1"  # m2's endpoint serves it under the name m1
    assert seen["body"]["some_worker_flag"] == {"kept": [1, 2]}
    assert not {"models", "fail_fast", "service_tier"} & set(seen["body"])
    assert "authorization" not in seen["headers"]
    assert resp.json()["model"] == "m2"
    assert resp.json()["service_tier"] == "default"  # m2 lists only default


def test_stream_always_asks_the_worker_for_usage(fleet: Fleet, http: httpx.Client) -> None:
    body = {
        "model": "m1",
        "prompt": "hi",
        "stream": True,
        "stream_options": {"include_usage": False},
    }
    resp = http.post("/v1/completions", json=body, headers={"x-request-id": "rid-usage-1"})
    assert resp.status_code == 200
    assert '"usage":{' not in resp.text
    assert resp.text.rstrip().endswith("data: [DONE]")
    seen = _last_request(fleet, "rid-usage-1")
    assert seen["body"]["stream_options"]["include_usage"] is True


@pytest.mark.parametrize("bad", [b"a\tb", b"x" * 200, "caf\u00e9".encode()])
def test_unusable_request_id_is_replaced(http: httpx.Client, bad: bytes) -> None:
    resp = http.post(
        "/v1/completions", json={"model": "m1", "prompt": "x"}, headers={b"x-request-id": bad}
    )
    assert resp.headers["x-request-id"].encode() != bad
    assert len(resp.headers["x-request-id"]) == 32


# docs/api.md tiers, end to end: (body value, header value, model, key) -> applied tier.
TIER_TABLE = [
    (None, None, "m1", KEY, "default"),
    ("priority", None, "m1", KEY, "priority"),
    ("flex", "priority", "m1", KEY, "flex"),  # body beats header
    (None, "priority", "m1", KEY, "priority"),
    (None, "flex", "m1", KEY, "flex"),
    (None, "gold", "m1", KEY, "default"),  # junk header rides default
    ("auto", None, "m1", KEY, "priority"),
    ("standard_only", "priority", "m1", KEY, "default"),
    ("priority", None, "m2", KEY, "default"),  # m2 does not list priority
    ("priority", None, "m1", KEY_LIMITED, "default"),  # the key may not use priority
    ("flex", None, "m1", KEY_LIMITED, "flex"),
]


@pytest.mark.parametrize(("body_tier", "header_tier", "model", "key", "applied"), TIER_TABLE)
def test_tier_resolution(
    fleet: Fleet, body_tier: str | None, header_tier: str | None, model: str, key: str, applied: str
) -> None:
    body: dict[str, Any] = {"model": model, "prompt": "x", "max_tokens": 1}
    if body_tier is not None:
        body["service_tier"] = body_tier
    headers = {"Authorization": f"Bearer {key}"}
    if header_tier is not None:
        headers["x-deepinfra-service-tier"] = header_tier
    resp = httpx.post(fleet.gateway.url + "/v1/completions", json=body, headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.json()["service_tier"] == applied


def test_worker_404_is_a_502_envelope(http: httpx.Client) -> None:
    resp = http.post(
        "/v1/chat/completions",
        json={"model": "misnamed", "messages": [{"role": "user", "content": "x"}]},
    )
    assert resp.status_code == 502
    assert resp.json()["error"]["type"] == "api_error"


@pytest.mark.parametrize(
    "path",
    ["/healthz", "/readyz", "/metrics", "/openapi.json", "/v1/models", "/v1/models/m1", "/nope"],
)
def test_every_response_has_a_request_id(http: httpx.Client, path: str) -> None:
    assert len(http.get(path).headers["x-request-id"]) == 32
    assert http.get(path, headers={"x-request-id": "mine-1"}).headers["x-request-id"] == "mine-1"


def test_operator_routes(http: httpx.Client) -> None:
    assert http.get("/healthz").status_code == 200
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    metrics = http.get("/metrics").text
    assert "gateway_requests_total{" in metrics
    assert 'gateway_capacity{model="m1"} 8.0' in metrics
    spec = http.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions"} <= set(spec["paths"])
    temperature = spec["components"]["schemas"]["OpenAICompletionsIn"]["properties"]["temperature"]
    assert temperature["maximum"] == 2
