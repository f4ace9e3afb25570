"""Property: whatever JSON the edge accepts, the forward body encodes and round-trips; what it
cannot pass on intact (lone surrogates, nesting past MAX_DEPTH) is a 422, never a crash."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from hypothesis import event, given, settings
from pydantic import BaseModel, ConfigDict

from gateway.completions.hop import worker_body
from gateway.edge.asgi import error_parts
from gateway.edge.body import MAX_DEPTH, dumps, parse_body
from gateway.errors import RequestInvalid
from tests.gateway.json_text import bodies, depth, has_lone_surrogate
from tiers.policy import Tier


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str


def forward(payload: dict[str, Any]) -> bytes:
    """The body a worker would get (streaming, with vLLM's priority), as the proxy builds it."""
    model = SimpleNamespace(config=SimpleNamespace(worker_priority=True))
    admitted = SimpleNamespace(candidate=SimpleNamespace(model=model), tier=Tier.FLEX)
    endpoint = SimpleNamespace(upstream_model="served")
    return worker_body(payload, True, admitted, endpoint)  # type: ignore[arg-type]


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(body=bodies({"model": '"m"'}))
def test_accepted_bodies_forward_and_round_trip(body: bytes) -> None:
    # The reference reading: the stdlib keeps lone surrogates and exact integers.
    reference = json.loads(body.decode("utf-8"))
    unfit = has_lone_surrogate(reference) or depth(reference) > MAX_DEPTH
    event("deep" if depth(reference) > MAX_DEPTH - 5 else "shallow")
    try:
        payload, _ = parse_body(body, Body)
    except RequestInvalid as exc:
        assert unfit, exc.detail
        [error] = exc.detail
        assert error["loc"][0] == "body"
        assert error["type"] in {"string_unicode", "nesting_too_deep"}
        event(f"refused: {error['type']}")
        status, rendered, _ = error_parts(exc, "r")
        assert status == 422
        assert orjson.loads(rendered)["error"]["code"] == "invalid_request"
        return
    assert not unfit
    event("accepted")
    assert payload == reference  # both parse paths read what the stdlib reads
    assert parse_body(dumps(payload), Body)[0] == payload
    sent, _ = parse_body(forward(payload), Body)
    expected = {k: v for k, v in payload.items() if k not in {"models", "fail_fast"}}
    expected.pop("service_tier", None)
    options = payload.get("stream_options")
    expected |= {
        "model": "served",
        "stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True},
        "priority": 1,
    }
    assert sent == expected
