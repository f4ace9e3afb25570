"""The completion route in process (scripted upstream, fakeredis): hostile bodies get a 4xx
naming the field, an unforeseen failure gets the OpenAI-envelope 500 (or an SSE error event),
and either way the slot goes back and the usage record tells what the caller got."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import fakeredis
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.app.front import build_app
from gateway.completions import hop, route
from gateway.completions.preempt import unless_preempted
from gateway.runtime.settings import parse_config
from gateway.runtime.state import GatewayState
from routing.errors import Preempted
from routing.store.keys import USAGE_STREAM
from tests.gateway.app.test_app import (
    CONFIG,
    KEY,
    STREAM,
    ScriptedResponse,
    ScriptedUpstream,
    _settled,
    make_app,
)
from tests.gateway.json_text import bodies

CHAT = "/v1/chat/completions"
BASE = b'{"model": "m1", "messages": [{"role": "user", "content": "secret prompt"}]'
BIG = b', "n_big": 123456789012345678901'
DEEP = b', "deep": ' + b"[" * 1000 + b"]" * 1000


async def send(app: Any, body: bytes, rid: str, path: str = CHAT) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        headers = {"authorization": f"Bearer {KEY}", "x-request-id": rid}
        response = await client.post(path, content=body, headers=headers)
    await _settled(app)  # the release goes out after the answer is complete
    return response


async def records(app: Any, rid: str) -> list[dict[str, str]]:
    entries = await app.state.redis.xrange(USAGE_STREAM)
    found = [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]
    return [r for r in found if r["request_id"] == rid]


async def leases_left(app: Any) -> int:
    assert not app.state.admission.held
    return sum([await app.state.redis.zcard(f"gw:v2:{{{m}}}:leases") for m in ("m1", "m2")])


def requests_counted(app: Any, model: str, tier: str, code: str) -> float:
    labels = {"model": model, "tier": tier, "code": code}
    value = app.state.metrics.registry.get_sample_value("gateway_requests_total", labels)
    return value or 0.0


# --- hostile bodies ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (b', "user": "\\ud800"' + BIG, "user"),
        (b', "user": "\\ud800"', "user"),
        (b', "prompt_cache_key": "\\udfff"' + BIG, "prompt_cache_key"),
        (b', "prompt_cache_key": "x\\ud800"', "prompt_cache_key"),
        (b', "metadata": {"x": "\\udc00"}' + BIG, "metadata.x"),
        (b', "metadata": {"\\ud800": 1}' + BIG, "metadata"),
        (DEEP, "deep"),
        (b', "deep": ' + b"[" * 300 + b"]" * 300 + BIG, "deep"),
    ],
)
async def test_hostile_body_is_422_naming_the_field(extra: bytes, field: str) -> None:
    app, upstream = make_app()
    rid = uuid.uuid4().hex
    resp = await send(app, BASE + extra + b"}", rid)
    assert resp.status_code == 422, resp.text
    assert resp.headers["x-request-id"] == rid
    body = resp.json()
    assert ".".join(str(p) for p in body["detail"][0]["loc"]) == f"body.{field}"
    assert body["error"]["param"] == field
    assert body["error"]["message"].startswith(f"{field}: ")
    assert (body["error"]["type"], body["error"]["code"]) == (
        "invalid_request_error",
        "invalid_request",
    )
    assert upstream.sent == []
    assert await records(app, rid) == []
    assert await leases_left(app) == 0
    assert requests_counted(app, "", "", "422") == 1


async def test_surrogate_pair_and_big_int_are_forwarded_intact() -> None:
    app, upstream = make_app()
    rid = uuid.uuid4().hex
    resp = await send(app, BASE + b', "user": "\\ud83d\\ude00"' + BIG + b"}", rid)
    assert resp.status_code == 200, resp.text
    _, sent, _ = upstream.sent[-1]
    assert sent["user"] == "\U0001f600"
    [record] = await records(app, rid)
    assert (record["user"], record["status"], record["outcome"]) == (
        "\U0001f600",
        "200",
        "complete",
    )
    assert await leases_left(app) == 0


# --- the last resort -----------------------------------------------------------------------


def explode(*_: Any) -> bytes:
    raise ValueError("secret prompt")  # its text must not reach the log


async def test_failure_before_the_answer_is_a_500_envelope(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    app, upstream = make_app()
    monkeypatch.setattr(hop, "worker_body", explode)
    rid = uuid.uuid4().hex
    with caplog.at_level(logging.ERROR, logger="gateway.route"):
        resp = await send(app, BASE + b"}", rid)
    assert resp.status_code == 500
    assert resp.headers["x-request-id"] == rid
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("api_error", "internal_error", None)
    assert "secret" not in error["message"]
    assert upstream.sent == []
    [record] = await records(app, rid)
    assert (record["status"], record["outcome"]) == ("500", "error")
    assert await leases_left(app) == 0
    assert requests_counted(app, "m1", "default", "500") == 1
    [logged] = [r.getMessage() for r in caplog.records if r.name == "gateway.route"]
    assert rid in logged
    assert "ValueError" in logged
    assert "gateway/" in logged  # where in the gateway's own code it went wrong
    assert " gateway/completions/hop.py:" in logged  # the innermost frame of ours, shortened
    assert "secret" not in logged


async def test_a_record_that_cannot_be_built_still_releases_the_slot_and_is_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app, _ = make_app()
    monkeypatch.setattr(route, "usage_fields", explode)
    rid = uuid.uuid4().hex
    resp = await send(app, BASE + b"}", rid)
    assert resp.status_code == 200  # the caller got its answer
    assert await records(app, rid) == []
    assert await leases_left(app) == 0
    spool = app.state.admission.ledger.spool
    assert spool is not None and spool.lost == 1


class BreakingStream(ScriptedResponse):
    """A worker stream whose reading fails in a way nobody foresaw, after a first event."""

    async def chunks(self) -> AsyncIterator[bytes]:
        yield STREAM.split(b"\n\n")[0] + b"\n\n"
        raise ValueError("secret prompt")


async def test_failure_mid_stream_ends_it_with_an_error_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app, upstream = make_app()

    async def post(url: str, body: bytes, headers: dict[str, str]) -> BreakingStream:
        return BreakingStream(200, b"")

    monkeypatch.setattr(upstream, "post", post)
    rid = uuid.uuid4().hex
    resp = await send(app, BASE + b', "stream": true}', rid)
    assert resp.status_code == 200  # the status was out before the failure
    events = [e for e in resp.text.split("\n\n") if e]
    assert events[0].startswith("data: {")
    last = orjson.loads(events[-1].removeprefix("data: "))
    assert (last["error"]["type"], last["error"]["code"]) == ("api_error", "internal_error")
    assert "data: [DONE]" not in events
    [record] = await records(app, rid)
    assert (record["status"], record["outcome"]) == ("500", "error")
    assert await leases_left(app) == 0
    assert requests_counted(app, "m1", "default", "500") == 1


async def test_failure_before_admission_is_a_500_not_counted_as_admitted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app, upstream = make_app()

    def broken(*_: Any, **__: Any) -> None:
        raise KeyError("secret prompt")

    monkeypatch.setattr(route, "plan_candidates", broken)
    rid = uuid.uuid4().hex
    resp = await send(app, BASE + b"}", rid)
    assert resp.status_code == 500
    assert resp.json()["error"]["code"] == "internal_error"
    assert resp.headers["x-request-id"] == rid
    assert upstream.sent == []
    assert await records(app, rid) == []
    assert await leases_left(app) == 0
    assert requests_counted(app, "", "", "500") == 1


# --- metric labels of requests turned away ---------------------------------------------------


@pytest.mark.parametrize(("models", "counted"), [(None, "m1"), (["m2", "m1"], "m2")])
async def test_an_admission_store_outage_is_a_503_counted_under_the_model_tried(
    monkeypatch: pytest.MonkeyPatch, models: list[str] | None, counted: str
) -> None:
    app, upstream = make_app()

    def down(*_: Any) -> asyncio.Future[list[Any]]:
        failed: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        failed.set_exception(RedisConnectionError("connection refused"))
        return failed

    monkeypatch.setattr(app.state.admission.scripts, "send", down)
    extra = b"" if models is None else b', "models": ' + orjson.dumps(models)
    resp = await send(app, BASE + extra + b"}", uuid.uuid4().hex)
    assert resp.status_code == 503, resp.text
    assert upstream.sent == []
    # The walk stops at the first model (on_outage: reject): that is the one counted.
    assert requests_counted(app, counted, "default", "503") == 1
    assert requests_counted(app, "", "", "503") == 0


async def test_a_preempted_flex_request_is_counted_once_under_its_model_and_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flex request preempted before its first byte (tiers.flex.on_preempt: reject): its
    429 once in gateway_requests_total and its rejection under the model and tier it was
    admitted at, not also under empty labels (docs/metrics.md)."""
    app, _ = make_app()

    async def preempted(hop: Any, *_: Any) -> None:
        hop.close()
        raise Preempted("taken by a request of a higher tier", 1)

    monkeypatch.setattr(route, "unless_preempted", preempted)
    body = BASE + b', "service_tier": "flex"}'
    resp = await send(app, body, uuid.uuid4().hex)
    assert (resp.status_code, resp.json()["error"]["code"]) == (429, "preempted")
    assert requests_counted(app, "m1", "flex", "429") == 1
    assert requests_counted(app, "", "", "429") == 0
    labels = {"model": "m1", "tier": "flex", "reason": "preempted"}
    registry = app.state.metrics.registry
    assert registry.get_sample_value("gateway_rejections_total", labels) == 1


async def test_an_unknown_model_is_a_404_counted_without_a_model() -> None:
    app, _ = make_app()
    resp = await send(
        app, b'{"model": "no-such", "messages": [{"role": "user", "content": "x"}]}', "r"
    )
    assert resp.status_code == 404
    assert requests_counted(app, "", "", "404") == 1


# --- fuzz through the whole app -------------------------------------------------------------


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[asyncio.AbstractEventLoop, Any]]:
    loop = asyncio.new_event_loop()
    yield loop, make_app()[0]
    loop.close()


VALID = {
    "/v1/completions": {"model": '"m1"', "prompt": '"x"'},
    CHAT: {"model": '"m1"', "messages": '[{"role":"user","content":"x"}]'},
}


@pytest.mark.slow
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), path=st.sampled_from(sorted(VALID)), stream=st.booleans())
def test_fuzzed_bodies_never_5xx_and_never_leak(
    shared: tuple[asyncio.AbstractEventLoop, Any], data: st.DataObject, path: str, stream: bool
) -> None:
    loop, app = shared
    base = {**VALID[path], "stream": "true" if stream else "false"}
    body = data.draw(bodies(base))
    rid = uuid.uuid4().hex
    resp = loop.run_until_complete(send(app, body, rid, path))
    assert resp.status_code in {200, 413, 422}, resp.text
    event(f"status {resp.status_code}")
    found = loop.run_until_complete(records(app, rid))
    # Only admitted requests have a record, exactly one; no slot stays held either way.
    assert len(found) == (1 if resp.status_code == 200 else 0)
    if found:
        assert (found[0]["status"], found[0]["outcome"]) == ("200", "complete")
    if resp.status_code == 422:
        assert resp.json()["detail"][0]["loc"][0] == "body"
        assert resp.json()["error"]["code"] == "invalid_request"
    assert loop.run_until_complete(leases_left(app)) == 0


async def test_tools_with_an_integer_past_64_bits_are_served_not_a_500() -> None:
    """Any body gets a 4xx or a 2xx, never a 500 from the gateway itself (docs/api.md); the token
    estimate of a chat's tools (gateway/schemas/tokens.py) must take what the edge took."""
    app, _ = make_app()
    tools = b'[{"type": "function", "function": {"name": "f", "parameters": {"m": 1' + b"0" * 30
    resp = await send(app, BASE + b', "tools": ' + tools + b"}}}]}", uuid.uuid4().hex)
    assert resp.status_code == 200, resp.text


async def test_a_preempted_flex_request_served_on_its_second_admission_counts_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tiers.flex.on_preempt: requeue: a request preempted, queued again and then served
    counts once in gateway_requests_total, with the answer its caller got (200), not also
    a 429 it never saw (nor a second duration)."""
    config = parse_config(CONFIG + "tiers: {flex: {on_preempt: requeue}}\n", "unit.yaml")
    state = GatewayState(config, redis=fakeredis.FakeAsyncRedis(), upstream=ScriptedUpstream())  # type: ignore[arg-type]
    app = build_app(state)
    tries: list[int] = []
    real = unless_preempted

    async def preempted_once(hop: Any, *args: Any) -> None:
        tries.append(1)
        if len(tries) == 1:
            hop.close()
            raise Preempted("taken by a request of a higher tier", 1)
        await real(hop, *args)

    monkeypatch.setattr(route, "unless_preempted", preempted_once)
    resp = await send(app, BASE + b', "service_tier": "flex"}', uuid.uuid4().hex)
    assert resp.status_code == 200, resp.text
    assert len(tries) == 2
    assert requests_counted(app, "m1", "flex", "200") == 1
    assert requests_counted(app, "m1", "flex", "429") == 0
    registry = app.state.metrics.registry
    labels = {"model": "m1", "tier": "flex"}
    assert registry.get_sample_value("gateway_request_duration_seconds_count", labels) == 1
