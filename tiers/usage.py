"""Usage records: what one admitted request used, at which tier and model, and its price.

One record per admitted request, whatever the outcome (docs/usage.md). Fields are flat, so a record
is one Redis stream entry and one JSONL/CSV row. Prices are USD per million tokens times the
applied tier's multiplier.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from operator import attrgetter
from typing import Any, Literal

Outcome = Literal["complete", "cancelled", "error"]

# Free text from callers is cut, so a record stays small and a label stays a label.
MAX_SOURCE = 64
MAX_USER = 256


@dataclass(frozen=True, slots=True)
class UsageRecord:
    request_id: str
    ts: str  # ISO 8601, UTC, when the request ended
    account: str
    key_id: str  # the key digest's first 12 hex digits, never the key
    user: str | None
    source: str | None
    requested_model: str
    served_model: str
    fallback_index: int
    requested_tier: str
    tier: str  # applied
    prompt_tokens: int
    completion_tokens: int
    estimated: bool  # the worker sent no usage: the gateway counted
    status: int
    outcome: Outcome
    duration_ms: float
    queue_ms: float
    ttft_ms: float | None
    cost_usd: float
    # Tokens of an endpoint's KV-cache budget the request held while it ran (its prompt
    # estimate and answer cap; 0 where its model has no token budget). Absent from records
    # written before budgets: 0.
    reserved_tokens: int = 0
    # 1 for a flex admission whose slot a tier that may preempt took before its first byte:
    # it gave its caller nothing (no completion) and costs nothing; else 0 (absent before).
    # 0|1 in every form (docs/usage.md), not a bool (true/false in JSONL, True/False in CSV).
    preempted: int = 0

    def to_fields(self) -> dict[str, str]:
        """The record as a Redis stream entry: every value a string, None as ""."""
        # Not dataclasses.asdict: its deep copy costs more than the rest (hot path); the
        # values in one C call, each converted inline (a call per field cost twice as much).
        return {
            name: value if value.__class__ is str else _text(value)
            for name, value in zip(_NAMES, _values(self), strict=True)
        }

    @classmethod
    def from_fields(cls, raw: dict[str, str]) -> UsageRecord:
        return cls(**{f.name: _typed(f.name, raw.get(f.name, "")) for f in fields(cls)})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def encodable(fields: Mapping[str, str]) -> dict[str, str]:
    """The record with every value valid UTF-8, a new dict: a caller's text holding a lone
    UTF-16 surrogate (which JSON allows) becomes "?" there, so the record can always be sent
    to Redis and written to the spool."""
    if "".join(fields.values()).isascii():  # nearly every record: one check for all
        return dict(fields)
    return {k: v if v.isascii() else _utf8(v) for k, v in fields.items()}


def _utf8(value: str) -> str:
    return value.encode("utf-8", "replace").decode("utf-8")


def cost_usd(
    prompt_tokens: int,
    completion_tokens: int,
    input_per_mtok: float,
    output_per_mtok: float,
    multiplier: float,
) -> float:
    base = prompt_tokens * input_per_mtok + completion_tokens * output_per_mtok
    return round(base / 1_000_000 * multiplier, 9)


def cut(text: str | None, limit: int) -> str | None:
    if text is None:
        return None
    return text[:limit]


def utc_now_ms() -> str:
    """Now, as a record's `ts`: ISO 8601 in UTC to the millisecond, the text of
    `datetime.now(UTC).isoformat(timespec="milliseconds")` at a quarter of its cost (the
    date and time of day made once a second)."""
    now = time.time()
    second = int(now)
    if second != _SECOND[0]:
        _SECOND[:] = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
    return f"{_SECOND[1]}.{int((now - second) * 1000):03d}+00:00"


_SECOND: list[Any] = [-1, ""]  # the second `utc_now_ms` last saw, and its text


_NAMES = tuple(f.name for f in fields(UsageRecord))
_values = attrgetter(*_NAMES)
_INTS = {"fallback_index", "prompt_tokens", "completion_tokens", "status", "reserved_tokens"}
_FLAGS = {"preempted"}  # 0|1 (an entry says "1" or "0")
_FLOATS = {"duration_ms", "queue_ms", "ttft_ms", "cost_usd"}
_OPTIONAL = {"user", "source", "ttft_ms"}


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _typed(name: str, raw: str) -> Any:
    if raw == "" and name in _OPTIONAL:
        return None
    if name in _INTS:
        return int(raw or 0)
    if name in _FLOATS:
        return float(raw or 0)
    if name in _FLAGS:
        return int(raw == "1")
    if name == "estimated":
        return raw == "1"
    return raw
