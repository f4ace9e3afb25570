"""Browser apps calling the gateway (config `cors`, off by default): the preflight answered
without a key, an allowed origin's answers readable by the page, any other origin's not."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import REDIS_URL
from tests.e2e import procs
from tests.e2e.conftest import KEY, Fleet, digest

APP = "https://app.example.com"
PREFLIGHT = {
    "Origin": APP,
    "Access-Control-Request-Method": "POST",
    # What the openai package sends from a browser, besides its x-stainless-* headers.
    "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
}
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def cors_gateway(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[procs.Proc]:
    text = f"""
redis: {{url: "{REDIS_URL}"}}
cors: {{allow_origins: ["{APP}"], max_age_s: 120}}
models:
  m1: {{endpoints: [{{url: "{fleet.fast[0].url}", max_concurrency: 4}}]}}
keys: [{{sha256: "{digest(KEY)}", account: acme}}]
"""
    gateway = procs.gateway(tmp_path_factory.mktemp("cors"), text)
    try:
        yield gateway
    finally:
        gateway.stop()


def test_a_preflight_is_answered_without_a_key(cors_gateway: procs.Proc) -> None:
    resp = httpx.options(f"{cors_gateway.url}/v1/chat/completions", headers=PREFLIGHT)
    assert resp.status_code == 204
    assert resp.headers["access-control-allow-origin"] == APP
    assert "POST" in resp.headers["access-control-allow-methods"]
    allowed = resp.headers["access-control-allow-headers"].split(", ")
    assert {"authorization", "content-type", "x-stainless-os"} <= set(allowed)
    assert resp.headers["access-control-max-age"] == "120"
    assert resp.headers["vary"] == "Origin"


def test_an_allowed_origin_reads_the_answer_and_its_headers(cors_gateway: procs.Proc) -> None:
    resp = httpx.post(
        f"{cors_gateway.url}/v1/chat/completions", json=CHAT,
        headers={"Origin": APP, "Authorization": f"Bearer {KEY}"}, timeout=20,
    )  # fmt: skip
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] == APP
    assert "x-request-id" in resp.headers["access-control-expose-headers"].split(", ")
    for path in ("/v1/models", "/v1/nothing"):  # the other routes, and errors, alike
        other = httpx.get(cors_gateway.url + path, headers={"Origin": APP,
                          "Authorization": f"Bearer {KEY}"})  # fmt: skip
        assert other.headers["access-control-allow-origin"] == APP, path


def test_another_origin_gets_no_cors_headers(cors_gateway: procs.Proc) -> None:
    evil = {**PREFLIGHT, "Origin": "https://evil.example.com"}
    refused = httpx.options(f"{cors_gateway.url}/v1/chat/completions", headers=evil)
    assert refused.status_code == 403
    assert "access-control-allow-origin" not in refused.headers
    assert refused.json()["error"]["code"] == "cors_not_allowed"
    served = httpx.post(
        f"{cors_gateway.url}/v1/chat/completions", json=CHAT,
        headers={"Origin": "https://evil.example.com", "Authorization": f"Bearer {KEY}"},
        timeout=20,
    )  # fmt: skip
    assert "access-control-allow-origin" not in served.headers


def test_cors_is_off_by_default(fleet: Fleet) -> None:
    resp = httpx.options(f"{fleet.base_url}/chat/completions", headers=PREFLIGHT)
    assert resp.status_code == 405
    assert "access-control-allow-origin" not in resp.headers
