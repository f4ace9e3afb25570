"""Usage records (docs/usage.md): prices, cut labels, and the flat stream-entry form and back."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import pytest

from tests.factories import usage_record
from tiers.usage import MAX_SOURCE, MAX_USER, UsageRecord, cost_usd, cut

# docs/usage.md, in the order it lists them.
SPEC_FIELDS = [
    "request_id", "ts", "account", "key_id", "user", "source", "requested_model",
    "served_model", "fallback_index", "requested_tier", "tier", "prompt_tokens",
    "completion_tokens", "estimated", "status", "outcome", "duration_ms", "queue_ms",
    "ttft_ms", "cost_usd",
    # The tokens of a worker's KV-cache budget the request held (docs/usage.md).
    "reserved_tokens", "preempted",
]  # fmt: skip


def record(**changes: Any) -> UsageRecord:
    made = usage_record(
        user="alice@example.com", source="nightly-batch", served_model="small",
        fallback_index=1, requested_tier="priority", prompt_tokens=1234, completion_tokens=56,
        duration_ms=812.125, queue_ms=3.5, ttft_ms=41.25, cost_usd=0.000834,
    )  # fmt: skip
    return replace(made, **changes)


# --- cost_usd --------------------------------------------------------------------------------


def test_cost_is_price_per_million_tokens_times_multiplier() -> None:
    assert cost_usd(1_000_000, 1_000_000, 0.64, 0.80, 1.5) == 2.16


def test_cost_of_prompt_and_completion_add_up() -> None:
    assert cost_usd(2_000_000, 0, 0.64, 0.80, 1.0) == 1.28
    assert cost_usd(0, 500_000, 0.64, 0.80, 1.0) == 0.4
    assert cost_usd(2_000_000, 500_000, 0.64, 0.80, 0.5) == 0.84


@pytest.mark.parametrize(
    ("prompt", "completion", "input_price", "output_price", "multiplier"),
    [
        (0, 0, 0.64, 0.80, 1.5),
        (1000, 1000, 0.0, 0.0, 1.0),
        (1000, 1000, 0.64, 0.80, 0.0),
    ],
)
def test_cost_is_zero_without_tokens_price_or_multiplier(
    prompt: int, completion: int, input_price: float, output_price: float, multiplier: float
) -> None:
    assert cost_usd(prompt, completion, input_price, output_price, multiplier) == 0.0


def test_cost_is_rounded_to_nine_places() -> None:
    assert cost_usd(1, 1, 0.123456789123, 0.0, 1.0) == 1.23e-7
    assert cost_usd(1, 0, 0.0006, 0.0, 1.0) == 1e-9
    assert cost_usd(1, 0, 0.0004, 0.0, 1.0) == 0.0
    # Float noise is gone: 0.1 + 0.2 per million tokens is 0.3, not 0.30000000000000004.
    assert cost_usd(1_000_000, 1_000_000, 0.1, 0.2, 1.0) == 0.3


# --- cut -------------------------------------------------------------------------------------


def test_cut_keeps_none_and_short_text() -> None:
    assert cut(None, 4) is None
    assert cut("", 4) == ""
    assert cut("abc", 4) == "abc"
    assert cut("abcd", 4) == "abcd"


def test_cut_shortens_long_text_to_the_limit() -> None:
    assert cut("abcdef", 4) == "abcd"
    assert cut("u" * 1000, MAX_USER) == "u" * 256
    assert cut("s" * 1000, MAX_SOURCE) == "s" * 64


# --- stream entry form -----------------------------------------------------------------------


def test_fields_are_those_of_spec_7() -> None:
    assert list(record().to_fields()) == SPEC_FIELDS
    assert [f.name for f in fields(UsageRecord)] == SPEC_FIELDS


def test_fields_are_all_strings() -> None:
    flat = record(estimated=True, user=None, source=None, ttft_ms=None).to_fields()
    assert all(isinstance(v, str) for v in flat.values())
    assert flat["estimated"] == "1"
    assert flat["user"] == flat["source"] == flat["ttft_ms"] == ""
    assert flat["fallback_index"] == "1"
    assert flat["status"] == "200"
    assert flat["duration_ms"] == "812.125"
    assert record().to_fields()["estimated"] == "0"


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"user": None, "source": None, "ttft_ms": None},
        {"estimated": True, "outcome": "cancelled", "status": 499},
        {"estimated": False, "outcome": "error", "status": 502, "ttft_ms": None},
        {"prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0, "fallback_index": 0},
        {"duration_ms": 0.1 + 0.2, "queue_ms": 1e-9, "cost_usd": 2.16, "ttft_ms": 0.0},
        {"user": "ünïcode ✓", "source": 'a,b;"c"'},
    ],
)
def test_fields_round_trip(changes: dict[str, Any]) -> None:
    original = record(**changes)
    back = UsageRecord.from_fields(original.to_fields())
    assert back == original
    for f in fields(UsageRecord):
        assert type(getattr(back, f.name)) is type(getattr(original, f.name)), f.name


def test_from_fields_types_each_value() -> None:
    back = UsageRecord.from_fields(record().to_fields())
    assert isinstance(back.fallback_index, int)
    assert isinstance(back.prompt_tokens, int)
    assert isinstance(back.completion_tokens, int)
    assert isinstance(back.status, int)
    assert isinstance(back.estimated, bool)
    assert isinstance(back.duration_ms, float)
    assert isinstance(back.queue_ms, float)
    assert isinstance(back.ttft_ms, float)
    assert isinstance(back.cost_usd, float)


def test_preempted_is_0_or_1_in_every_form() -> None:
    # docs/usage.md: `preempted` is 0 or 1: in the stream, JSONL and CSV alike (a
    # bool exported as true/false, True/False in CSV); records written before: 0.
    flat = record(preempted=1).to_fields()
    assert (flat["preempted"], record().to_fields()["preempted"]) == ("1", "0")
    back = UsageRecord.from_fields(flat)
    assert type(back.preempted) is int and back.to_json()["preempted"] == 1
    old = {k: v for k, v in record().to_fields().items() if k != "preempted"}
    assert type(UsageRecord.from_fields(old).to_json()["preempted"]) is int


def test_to_json_keeps_native_types() -> None:
    data = record(user=None, estimated=True).to_json()
    assert list(data) == SPEC_FIELDS
    assert data["user"] is None
    assert data["estimated"] is True
    assert data["prompt_tokens"] == 1234
