"""`gateway usage export`: usage records out of the Redis stream, as JSONL or CSV, whole or
summed by account, tier and model (what finance asks for first)."""

from __future__ import annotations

import csv
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import orjson
import redis.asyncio as aioredis

from routing.store.keys import USAGE_STREAM
from tiers.usage import UsageRecord

GROUPS = {"account": "account", "tier": "tier", "model": "served_model", "source": "source"}


class Sink(Protocol):
    """Where the export goes: stdout, a file, a StringIO."""

    def write(self, text: str, /) -> int: ...


BATCH = 1000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def since_id(since: str | None) -> str:
    """A stream id from an ISO 8601 time (UTC when no zone is given)."""
    if not since:
        return "-"
    moment = datetime.fromisoformat(since)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    # Exact integer milliseconds (a float product would round 1.001 s down to 1000 ms).
    return f"{(moment - _EPOCH) // timedelta(milliseconds=1)}-0"


async def records(redis: aioredis.Redis, since: str | None) -> AsyncIterator[UsageRecord]:
    start = since_id(since)
    while True:
        entries = await redis.xrange(USAGE_STREAM, min=start, max="+", count=BATCH) or []
        for _, raw in entries:
            decoded = {_s(k): _s(v) for k, v in (raw or {}).items()}
            yield UsageRecord.from_fields(decoded)
        if len(entries) < BATCH:
            return
        start = "(" + _s(entries[-1][0])


def write_rows(rows: Iterable[dict[str, Any]], columns: Sequence[str], fmt: str, out: Sink) -> int:
    count = 0
    writer = csv.DictWriter(out, fieldnames=list(columns)) if fmt == "csv" else None
    if writer is not None:
        writer.writeheader()
    for row in rows:
        if writer is not None:
            writer.writerow({k: _cell(row[k]) for k in columns})
        else:
            out.write(orjson.dumps(row).decode() + "\n")
        count += 1
    return count


# A cell starting so is run as a formula by spreadsheets (OWASP, "CSV injection").
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _cell(value: Any) -> Any:
    """A CSV cell: None empty; a string a spreadsheet would run as a formula quoted with a
    leading apostrophe. Numbers stay numbers (-1.5 is a value, not a formula)."""
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


RECORD_COLUMNS = [f.name for f in fields(UsageRecord)]
TOTAL_COLUMNS = ["requests", "prompt_tokens", "completion_tokens", "cost_usd", "estimated",
                 "errors", "cancelled"]  # fmt: skip


def summarize(items: Iterable[UsageRecord], by: Sequence[str]) -> list[dict[str, Any]]:
    totals: dict[tuple[Any, ...], dict[str, Any]] = {}
    for record in items:
        key = tuple(getattr(record, GROUPS[g]) for g in by)
        row = totals.setdefault(
            key, {**dict(zip(by, key, strict=True)), **dict.fromkeys(TOTAL_COLUMNS, 0)}
        )
        row["requests"] += 1
        row["prompt_tokens"] += record.prompt_tokens
        row["completion_tokens"] += record.completion_tokens
        row["cost_usd"] = round(row["cost_usd"] + record.cost_usd, 9)
        row["estimated"] += int(record.estimated)
        row["errors"] += int(record.outcome == "error")
        row["cancelled"] += int(record.outcome == "cancelled")
    return [totals[k] for k in sorted(totals, key=lambda k: tuple(str(v) for v in k))]


async def export(
    redis: aioredis.Redis, since: str | None, fmt: str, by: Sequence[str] | None, out: Sink
) -> int:
    """Write the records (or their totals) to `out`; the number of rows written."""
    collected = [r async for r in records(redis, since)]
    if by:
        return write_rows(summarize(collected, by), [*by, *TOTAL_COLUMNS], fmt, out)
    return write_rows((r.to_json() for r in collected), RECORD_COLUMNS, fmt, out)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
