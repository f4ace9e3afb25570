"""Small factories shared by tests of several packages."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tiers.usage import UsageRecord

_RECORD = UsageRecord(
    request_id="req-1",
    ts="2024-01-02T03:04:05.678+00:00",
    account="t-acme",
    key_id="0123456789ab",
    user=None,
    source="batch",
    requested_model="big",
    served_model="big",
    fallback_index=0,
    requested_tier="default",
    tier="default",
    prompt_tokens=100,
    completion_tokens=10,
    estimated=False,
    status=200,
    outcome="complete",
    duration_ms=12.5,
    queue_ms=0.25,
    ttft_ms=3.0,
    cost_usd=0.0001,
)


def usage_record(**changes: Any) -> UsageRecord:
    """A complete usage record; `changes` override its fields."""
    return replace(_RECORD, **changes)
