"""The usage record of one admitted request (docs/usage.md), from what the edge saw of it: reported
or estimated tokens, the outcome, timings, labels, and the price at the applied tier."""

from __future__ import annotations

import re
import time
from dataclasses import fields as dataclass_fields
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gateway.completions.billing import usage_fields
from gateway.completions.exchange import Exchange, Usage
from gateway.completions.streamusage import StreamUsage
from gateway.runtime.settings import parse_config
from routing.admission.admit import Admitted, Lease
from routing.admission.plan import Candidate
from routing.registry import Registry
from tiers.policy import Tier, TiersConfig
from tiers.usage import UsageRecord, utc_now_ms

CONFIG = """
models:
  big:
    tiers: [default, priority, flex]
    price: {input_per_mtok: 0.64, output_per_mtok: 0.80}
    endpoints:
      - {url: "http://big-a:8000", max_concurrency: 4}
  free:
    endpoints:
      - {url: "http://free-a:8000", max_concurrency: 1}
"""
CONFIG_PARSED = parse_config(CONFIG, "t.yaml")
REGISTRY = Registry(CONFIG_PARSED.models)
TIERS = TiersConfig()
MILLION = 1_000_000


def exchange(
    usage: Usage | None = None,
    *,
    status: int = 200,
    elapsed_s: float = 0.25,
    ttft_s: float | None = None,
    stream: bool = True,
) -> Exchange:
    started = time.perf_counter() - elapsed_s
    made = Exchange("req-1", started, stream, StreamUsage(), usage or Usage(), status=status)
    if ttft_s is not None:
        made.first_byte = started + ttft_s
    return made


def admitted(
    model: str = "big", tier: Tier = Tier.DEFAULT, *, index: int = 0, queued_ms: float = 0.0
) -> Admitted:
    found = REGISTRY.get(model)
    assert found is not None
    lease = Lease("lease-1", model, "http://big-a:8000", "gw:v2:acct:{t-acme}", queued_ms)
    return Admitted(lease, Candidate(found, index, False), tier)


def build(exch: Exchange | None = None, adm: Admitted | None = None, **given: Any) -> UsageRecord:
    """The typed record (`build_fields`' keywords): the stream entry's fields read back."""
    return UsageRecord.from_fields(build_fields(exch, adm, **given))


def build_fields(
    exch: Exchange | None = None,
    adm: Admitted | None = None,
    *,
    payload: dict[str, Any] | None = None,
    user: str | None = "alice",
    source: str | None = "batch",
    tiers: TiersConfig = TIERS,
) -> dict[str, str]:
    return usage_fields(
        exch or exchange(Usage(1000, 50, reported=True)),
        adm or admitted(),
        account="t-acme",
        key_id="0123456789ab",
        requested_model="big",
        requested_tier="priority",
        user=user,
        source=source,
        payload={"prompt": "hello"} if payload is None else payload,
        tiers=tiers,
    )


# --- tokens ----------------------------------------------------------------------------------


def test_reported_usage_is_billed_as_is() -> None:
    usage = Usage(prompt_tokens=1234, completion_tokens=56, reported=True, streamed=9)
    rec = build(exchange(usage), payload={"prompt": "x" * 4000})
    assert (rec.prompt_tokens, rec.completion_tokens, rec.estimated) == (1234, 56, False)


def test_unreported_usage_is_estimated_from_the_stream_and_prompt() -> None:
    usage = Usage(prompt_tokens=0, completion_tokens=0, reported=False, streamed=7)
    rec = build(exchange(usage), payload={"prompt": "x" * 41})
    assert (rec.prompt_tokens, rec.completion_tokens, rec.estimated) == (10, 7, True)


@pytest.mark.parametrize(
    ("payload", "prompt_tokens"),
    [
        ({"prompt": "abcd" * 25}, 25),  # text: about four characters a token
        ({"prompt": "abc"}, 1),  # never less than one
        ({"prompt": ""}, 1),
        ({"prompt": [101, 7592, 2088, 102]}, 4),  # token ids: counted
        (
            {
                "messages": [
                    {"role": "system", "content": "s" * 20},
                    {"role": "user", "content": "u" * 20},
                ]
            },
            10,
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "t" * 16},
                            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                            {"type": "text", "text": "t" * 8},
                        ],
                    },
                    {"role": "assistant", "content": None},
                ]
            },
            6,
        ),
        ({"messages": []}, 1),
        # Other part types may carry a "text" of any JSON type: only strings count.
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_audio", "text": 5},
                            {"type": "x", "text": ["a"]},
                            {"type": "text", "text": "t" * 8},
                        ],
                    }
                ]
            },
            2,
        ),
    ],
)
def test_estimated_prompt_tokens(payload: dict[str, Any], prompt_tokens: int) -> None:
    rec = build(exchange(Usage(streamed=3)), payload=payload)
    assert rec.estimated
    assert rec.prompt_tokens == prompt_tokens
    assert rec.completion_tokens == 3


def test_unreported_usage_of_a_failed_request_before_any_chunk() -> None:
    rec = build(exchange(Usage(), status=502), payload={"prompt": "x" * 80})
    assert (rec.prompt_tokens, rec.completion_tokens, rec.estimated) == (20, 0, True)


# --- outcome ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(200, "complete"), (499, "cancelled"), (502, "error"), (504, "error"), (400, "error")],
)
def test_outcome_from_status(status: int, outcome: str) -> None:
    rec = build(exchange(Usage(1, 1, reported=True), status=status))
    assert rec.status == status
    assert rec.outcome == outcome


# --- timings ---------------------------------------------------------------------------------


def test_ttft_is_none_without_a_first_byte() -> None:
    rec = build(exchange(Usage(1, 1, reported=True), ttft_s=None))
    assert rec.ttft_ms is None


def test_ttft_from_the_first_byte() -> None:
    rec = build(exchange(Usage(1, 1, reported=True), elapsed_s=0.5, ttft_s=0.125))
    assert rec.ttft_ms == pytest.approx(125.0, abs=0.001)


def test_duration_runs_from_the_start_to_now() -> None:
    rec = build(exchange(Usage(1, 1, reported=True), elapsed_s=0.25))
    assert rec.duration_ms >= 250.0
    assert rec.duration_ms == round(rec.duration_ms, 3)


def test_queue_time_is_the_lease_wait() -> None:
    rec = build(adm=admitted(queued_ms=12.34567))
    assert rec.queue_ms == 12.346


def test_ts_is_utc_iso_now() -> None:
    before = datetime.now(UTC)
    rec = build()
    ts = datetime.fromisoformat(rec.ts)
    assert ts.utcoffset() == timedelta(0)
    assert before - timedelta(milliseconds=1) <= ts <= datetime.now(UTC)


# --- price -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tier", "cost"), [(Tier.PRIORITY, 2.16), (Tier.DEFAULT, 1.44), (Tier.FLEX, 0.72)]
)
def test_cost_with_the_default_tier_multipliers(tier: Tier, cost: float) -> None:
    rec = build(exchange(Usage(MILLION, MILLION, reported=True)), admitted(tier=tier))
    assert rec.cost_usd == cost
    assert rec.tier == tier.value


def test_cost_with_configured_multipliers() -> None:
    tiers = TiersConfig.model_validate({"flex": {"price_multiplier": 0.25}})
    usage = Usage(MILLION, MILLION, reported=True)
    assert build(exchange(usage), admitted(tier=Tier.FLEX), tiers=tiers).cost_usd == 0.36
    assert build(exchange(usage), admitted(tier=Tier.PRIORITY), tiers=tiers).cost_usd == 2.16


def test_cost_of_estimated_tokens() -> None:
    usage = Usage(reported=False, streamed=MILLION)
    rec = build(exchange(usage), admitted(tier=Tier.PRIORITY), payload={"prompt": [1] * MILLION})
    assert rec.cost_usd == 2.16


def test_cost_of_an_unpriced_model_is_zero() -> None:
    rec = build(exchange(Usage(MILLION, MILLION, reported=True)), admitted("free"))
    assert rec.cost_usd == 0.0


# --- labels ----------------------------------------------------------------------------------


def test_labels_of_the_request_and_the_served_model() -> None:
    rec = build(adm=admitted("free", Tier.DEFAULT, index=2))
    assert rec.request_id == "req-1"
    assert (rec.account, rec.key_id) == ("t-acme", "0123456789ab")
    assert (rec.requested_model, rec.served_model, rec.fallback_index) == ("big", "free", 2)
    assert (rec.requested_tier, rec.tier) == ("priority", "default")
    assert (rec.user, rec.source) == ("alice", "batch")


def test_user_and_source_are_cut() -> None:
    rec = build(user="u" * 300, source="s" * 100)
    assert rec.user == "u" * 256
    assert rec.source == "s" * 64
    rec = build(user="u" * 256, source="s" * 64)
    assert (rec.user, rec.source) == ("u" * 256, "s" * 64)


def test_missing_user_and_source_stay_none() -> None:
    rec = build(user=None, source=None)
    assert rec.user is None
    assert rec.source is None


def test_record_survives_the_stream() -> None:
    rec = build(exchange(Usage(streamed=2), status=499, ttft_s=0.01), user=None)
    assert UsageRecord.from_fields(rec.to_fields()) == rec


@pytest.mark.parametrize(
    ("exch", "user", "source"),
    [
        (exchange(Usage(1000, 50, reported=True)), "alice", "batch"),
        (exchange(Usage(streamed=2), status=499, ttft_s=0.01), None, None),
        (exchange(status=502, ttft_s=0.5, stream=False), "u" * 300, ""),
    ],
)
def test_the_hot_paths_fields_are_the_records_stream_entry(
    exch: Exchange, user: str | None, source: str | None
) -> None:
    """`usage_fields` (the release's) writes exactly what the typed record would: its
    names in its order and its text, so a reader of the stream cannot tell them apart."""
    fields = build_fields(exch, admitted(queued_ms=1.23456), user=user, source=source)
    assert all(type(v) is str for v in fields.values())
    assert UsageRecord.from_fields(fields).to_fields() == fields
    assert list(fields) == [f.name for f in dataclass_fields(UsageRecord)]


def test_a_records_time_is_iso_8601_in_utc_to_the_millisecond() -> None:
    before = datetime.now(UTC)
    stamps = [utc_now_ms() for _ in range(2000)]  # across a millisecond boundary or more
    after = datetime.now(UTC)
    for ts in stamps:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", ts), ts
        when = datetime.fromisoformat(ts)
        assert before - timedelta(milliseconds=1) <= when <= after
    assert stamps == sorted(stamps)


def test_a_workers_boolean_token_count_is_written_as_the_typed_record_would() -> None:
    """JSON `true` is an int to Usage.take: the entry says "1", as to_fields wrote it."""
    usage = Usage()
    usage.take({"prompt_tokens": True, "completion_tokens": 3})
    fields = build_fields(exchange(usage))
    assert (fields["prompt_tokens"], fields["completion_tokens"]) == ("1", "3")
    assert UsageRecord.from_fields(fields).prompt_tokens == 1
