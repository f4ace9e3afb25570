"""Every bound of the seeds answers 422 naming the field; size and JSON errors are clean."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
from openai.types.chat import ChatCompletion

from tests import conftest
from tests.e2e.conftest import KEY, Fleet, Sdk

AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m1", "prompt": "hi"}

BAD_FIELDS: list[tuple[str, Any]] = [
    ("temperature", 2.1),
    ("top_p", 0),
    ("top_k", 1000),
    ("n", 5),
    ("max_tokens", 0),
    ("stop", [f"s{i}" for i in range(17)]),
    ("stop_token_ids", list(range(17))),
    ("models", ["a", "b", "c", "d", "e"]),
    ("models", ["deploy_id:x"]),
    ("service_tier", "gold"),
    ("seed", 2**64),
    ("presence_penalty", -2.5),
    ("repetition_penalty", 0),
    ("min_p", 1.5),
]


@pytest.fixture
def http(fleet: Fleet) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fleet.gateway.url, headers=AUTH, timeout=10) as client:
        yield client


@pytest.mark.parametrize(
    ("path", "base"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_out_of_bound_is_422_naming_the_field(
    http: httpx.Client, path: str, base: dict[str, Any], field: str, value: Any
) -> None:
    resp = http.post(path, json={**base, field: value})
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert detail[0]["loc"][:2] == ["body", field]
    assert {"loc", "msg", "type"} <= set(detail[0])


def test_chat_specific_bounds(http: httpx.Client) -> None:
    for body, field in [
        ({**CHAT, "reasoning_effort": "extreme"}, "reasoning_effort"),
        ({**CHAT, "cache_salt": ""}, "cache_salt"),
        ({**CHAT, "messages": []}, "messages"),
        ({"model": "m1", "messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ]:
        resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 422
        assert resp.json()["detail"][0]["loc"][1] == field


def test_missing_required_fields(http: httpx.Client) -> None:
    resp = http.post("/v1/completions", json={"model": "m1"})
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"] == ["body", "prompt"]


@pytest.mark.parametrize("raw", [b"{", b"[]", b"null", b'{"model": NaN}', b"\xff\xfe", b""])
def test_malformed_json_is_422(http: httpx.Client, raw: bytes) -> None:
    resp = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 422
    assert resp.json()["detail"][0]["loc"][0] == "body"


def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    resp = http.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 70_000})
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"


def test_body_over_the_limit_without_content_length_is_413(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "m1", "prompt": "'
        for _ in range(80):
            yield b"x" * 1000
        yield b'"}'

    resp = http.post("/v1/completions", content=chunks())
    assert resp.status_code == 413


def test_unknown_model_is_404(http: httpx.Client) -> None:
    resp = http.post("/v1/completions", json={**COMPLETION, "model": "nope"})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"
    resp = http.post("/v1/completions", json={**COMPLETION, "models": ["nope", "nada"]})
    assert resp.status_code == 404


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert http.get("/v1/nothing").json()["error"]["code"] == "not_found"
    resp = http.get("/v1/completions")
    assert resp.status_code == 405
    assert resp.json()["error"]["type"] == "invalid_request_error"


# --- bodies the gateway could not pass on intact (issue 10 item 5) -------------------------

BIG = b', "x_big": 12345678901234567890'  # 20 digits: the body goes to the stdlib parser
CRAFTED: list[tuple[bytes, str]] = [
    (b', "user": "\\ud800"' + BIG, "user"),
    (b', "user": "\\ud800"', "user"),
    (b', "prompt_cache_key": "\\ud800"', "prompt_cache_key"),
    (b', "prompt_cache_key": "\\udc00"' + BIG, "prompt_cache_key"),
    (b', "metadata": {"x": "\\udbff"}' + BIG, "metadata.x"),
    (b', "deep": ' + b"[" * 1000 + b"]" * 1000, "deep"),
]
RAW_BASE = {
    "/v1/completions": b'{"model": "m1", "prompt": "hi"',
    "/v1/chat/completions": b'{"model": "m1", "messages": [{"role": "user", "content": "hi"}]',
}


def leases_held(model: str) -> int:
    store = redis.Redis.from_url(conftest.REDIS_URL)  # read late: set when the run starts
    try:
        return int(store.zcard(f"gw:v2:{{{model}}}:leases"))
    finally:
        store.close()


def assert_names_field(body: dict[str, Any], field: str) -> None:
    assert ".".join(str(p) for p in body["detail"][0]["loc"]) == f"body.{field}"
    assert body["error"]["param"] == field
    assert body["error"]["message"].startswith(f"{field}: ")
    assert body["error"]["code"] == "invalid_request"


def five_hundreds(url: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=5).text.splitlines()
    counted = [ln for ln in lines if ln.startswith("gateway_requests_total{")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in counted if 'code="5' in ln)


@pytest.mark.parametrize("path", sorted(RAW_BASE))
@pytest.mark.parametrize(("extra", "field"), CRAFTED)
def test_crafted_body_is_422_naming_the_field(
    fleet: Fleet, http: httpx.Client, path: str, extra: bytes, field: str
) -> None:
    before = five_hundreds(fleet.gateway.url)
    resp = http.post(
        path, content=RAW_BASE[path] + extra + b"}", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 422, resp.text
    assert_names_field(resp.json(), field)
    assert resp.headers["x-should-retry"] == "false"
    assert five_hundreds(fleet.gateway.url) == before
    assert leases_held("m1") == 0


def test_crafted_bodies_through_the_openai_sdk(fleet: Fleet, sdk: Sdk) -> None:
    client = sdk(fleet.base_url)
    chat = RAW_BASE["/v1/chat/completions"]
    # The SDK cannot encode a lone surrogate itself: raw bytes, as another client would send.
    for extra, field in CRAFTED:
        with pytest.raises(openai.UnprocessableEntityError) as info:
            client.post("/chat/completions", cast_to=ChatCompletion, content=chat + extra + b"}")
        assert (info.value.param, info.value.code) == (field, "invalid_request")
        assert field in info.value.message
    # What the SDK can encode goes through extra_body (deeper than 300 its encoder recurses out).
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(
            model="m1",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"deep": deep, "x_big": 10**20},
        )
    assert info.value.param == "deep"
    assert leases_held("m1") == 0


def test_big_integers_still_reach_the_worker(http: httpx.Client) -> None:
    resp = http.post(
        "/v1/completions",
        content=RAW_BASE["/v1/completions"] + b', "max_tokens": 2' + BIG + b"}",
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 200, resp.text
