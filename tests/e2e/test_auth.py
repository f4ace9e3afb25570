"""Keys through each of the three headers, keys minted by `gateway keys create`, and 401s."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import httpx
import pytest
import redis

from tests.conftest import REDIS_URL
from tests.e2e.conftest import KEY, Fleet, keys_create

BODY = {"model": "m1", "prompt": "hi", "max_tokens": 2}


@pytest.fixture
def http(fleet: Fleet) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fleet.gateway.url, timeout=10) as client:
        yield client


@pytest.mark.parametrize(
    "headers",
    [{"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {"xi-api-key": KEY}],
    ids=["bearer", "x-api-key", "xi-api-key"],
)
def test_each_header_carries_a_key(http: httpx.Client, headers: dict[str, str]) -> None:
    assert http.post("/v1/completions", json=BODY, headers=headers).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer nope"},
        {"x-api-key": "nope"},
        {"Authorization": f"Basic {KEY}"},
    ],
    ids=["none", "wrong-bearer", "wrong-x-api-key", "not-bearer"],
)
def test_missing_or_wrong_key_is_401(http: httpx.Client, headers: dict[str, str]) -> None:
    resp = http.post("/v1/completions", json=BODY, headers=headers)
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == "Bearer"
    error = resp.json()["error"]
    assert error["type"] == "authentication_error"
    assert error["code"] == "invalid_api_key"
    assert set(error) == {"message", "type", "param", "code"}


def test_bearer_is_looked_at_first(http: httpx.Client) -> None:
    headers = {"Authorization": "Bearer wrong", "x-api-key": KEY}
    assert http.post("/v1/completions", json=BODY, headers=headers).status_code == 401


def test_key_minted_by_cli_works_and_is_stored_as_digest(fleet: Fleet, http: httpx.Client) -> None:
    key = keys_create(fleet.config_path, "--account", "cli-acct", "--max-concurrency", "5")
    assert key.startswith("gw-") and len(key) > 30
    resp = http.post("/v1/completions", json=BODY, headers={"x-api-key": key})
    assert resp.status_code == 200
    store = redis.Redis.from_url(REDIS_URL)
    try:
        stored = cast(dict[bytes, bytes], store.hgetall("gw:keys"))
    finally:
        store.close()
    assert all(key.encode() not in k + v for k, v in stored.items())
