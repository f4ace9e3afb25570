"""Audit of issue 10 item 5 from outside, on the real gateway process and Redis: lone
surrogates in the fields the issue did not list are refused naming the field (on both
parser paths), valid surrogate pairs pass whole, and neither leaks a slot or a 5xx."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest
import redis

from tests import conftest
from tests.e2e.conftest import Fleet
from tests.e2e.test_validation import BIG, RAW_BASE, assert_names_field, five_hundreds, http

_ = http  # the fixture
CHAT = "/v1/chat/completions"
MSG = b'{"model": "m1", "messages": [{"role": "user", "content": '

SURROGATES: list[tuple[str, bytes, str]] = [
    (CHAT, MSG + b'"\\ud800"}]', "messages.0.content"),
    (CHAT, MSG + b'[{"type": "text", "text": "x\\udfff"}]}]', "messages.0.content.0.text"),
    (CHAT, MSG + b'"x", "name": "\\udc00"}]', "messages.0.name"),
    (CHAT, RAW_BASE[CHAT] + b', "stop": ["\\ud800"]', "stop.0"),
    (
        CHAT,
        RAW_BASE[CHAT] + b', "tools": [{"type": "function", "function": '
        b'{"name": "f\\ud800", "parameters": {}}}]',
        "tools.0.function.name",
    ),
    (CHAT, RAW_BASE[CHAT] + b', "logit_bias": {"\\ud800": 1}', "logit_bias"),
    (
        CHAT,
        RAW_BASE[CHAT] + b', "response_format": {"type": "json_schema", '
        b'"json_schema": {"name": "\\ud800", "schema": {}}}',
        "response_format.json_schema.name",
    ),
    (CHAT, RAW_BASE[CHAT] + b', "cache_salt": "\\ud800"', "cache_salt"),
    (CHAT, RAW_BASE[CHAT] + b', "models": ["m1", "\\ud800"]', "models.1"),
    ("/v1/completions", RAW_BASE["/v1/completions"] + b', "stop": "\\ud800"', "stop"),
]


def leases_held() -> int:
    store = redis.Redis.from_url(conftest.REDIS_URL)
    try:
        return sum(int(store.zcard(f"gw:v2:{{{m}}}:leases")) for m in ("m1", "m2"))
    finally:
        store.close()


def recorded(rid: str) -> int:
    store = redis.Redis.from_url(conftest.REDIS_URL)
    try:
        entries: Any = store.xrange("usage")
        return sum(1 for _, f in entries if f[b"request_id"] == rid.encode())
    finally:
        store.close()


@pytest.mark.parametrize("tail", [b"", BIG], ids=["orjson", "stdlib"])
@pytest.mark.parametrize(("path", "body", "field"), SURROGATES)
def test_lone_surrogates_in_other_fields_are_422(
    fleet: Fleet, http: httpx.Client, path: str, body: bytes, field: str, tail: bytes
) -> None:
    before = five_hundreds(fleet.gateway.url)
    resp = http.post(path, content=body + tail + b"}", headers={"content-type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert_names_field(resp.json(), field)
    assert five_hundreds(fleet.gateway.url) == before
    assert leases_held() == 0


@pytest.mark.parametrize("tail", [b"", BIG], ids=["orjson", "stdlib"])
def test_valid_surrogate_pairs_everywhere_pass_and_are_recorded_once(
    http: httpx.Client, tail: bytes
) -> None:
    rid = f"audit-pair-{uuid.uuid4().hex[:8]}"
    body = (
        MSG + b'"\\ud83d\\ude00", "name": "\\uD83D\\uDE00"}], "stop": ["\\ud83d\\ude00"], '
        b'"user": "\\ud83d\\ude00", "max_tokens": 2' + tail + b"}"
    )
    resp = http.post(
        CHAT, content=body, headers={"content-type": "application/json", "x-request-id": rid}
    )
    assert resp.status_code == 200, resp.text
    assert leases_held() == 0
    deadline = time.monotonic() + 5  # the record rides the release, after the answer
    while recorded(rid) == 0:
        assert time.monotonic() < deadline, "no usage record"
        time.sleep(0.05)
    assert recorded(rid) == 1
