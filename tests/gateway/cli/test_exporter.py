"""`gateway usage export` (docs/usage.md): records out of the stream `usage`, since a time, as JSONL
or CSV, whole or summed by account, tier, model and source."""

from __future__ import annotations

import asyncio
import csv
import io
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson
import pytest
import redis.asyncio as aioredis

from gateway.cli import exporter
from gateway.cli.exporter import RECORD_COLUMNS, TOTAL_COLUMNS, export, records, since_id, summarize
from routing.store.keys import USAGE_STREAM
from tests.factories import usage_record
from tiers.usage import UsageRecord

BOUND_S = 5.0
T = TypeVar("T")


async def bounded(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, BOUND_S)


def record(rid: str = "req-1", **changes: Any) -> UsageRecord:
    return usage_record(request_id=rid, **changes)


async def add(client: aioredis.Redis, *items: UsageRecord | tuple[str, UsageRecord]) -> None:
    """XADD each record (a pair: with that stream id)."""
    for item in items:
        entry_id, rec = item if isinstance(item, tuple) else ("*", item)
        await client.xadd(USAGE_STREAM, rec.to_fields(), id=entry_id)  # type: ignore[arg-type]


async def exported(
    client: aioredis.Redis, fmt: str, *, since: str | None = None, by: list[str] | None = None
) -> tuple[int, str]:
    out = io.StringIO()
    count = await bounded(export(client, since, fmt, by, out))
    return count, out.getvalue()


def jsonl(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in text.splitlines()]


# --- since_id --------------------------------------------------------------------------------


def test_since_nothing_is_the_start_of_the_stream() -> None:
    assert since_id(None) == "-"
    assert since_id("") == "-"


def test_since_naive_time_is_utc() -> None:
    assert since_id("1970-01-01T00:00:01") == "1000-0"
    assert since_id("1970-01-01T00:00:05.250") == "5250-0"
    moment = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert since_id("2024-01-02T03:04:05") == f"{int(moment.timestamp()) * 1000}-0"
    assert since_id("2024-01-02") == f"{int(datetime(2024, 1, 2, tzinfo=UTC).timestamp())}000-0"


def test_since_time_with_offset() -> None:
    utc = since_id("2024-01-02T03:04:05")
    assert since_id("2024-01-02T03:04:05+00:00") == utc
    assert since_id("2024-01-02T03:04:05Z") == utc
    assert since_id("2024-01-02T05:04:05+02:00") == utc
    assert since_id("2024-01-01T22:04:05.123-05:00") == f"{int(utc[:-2]) + 123}-0"


@pytest.mark.parametrize(
    ("since", "expected"),
    [
        ("1970-01-01T00:00:01.001", "1001-0"),
        ("1987-02-10T02:03:06.009", "539920986009-0"),
    ],
)
def test_since_is_exact_to_the_millisecond(since: str, expected: str) -> None:
    assert since_id(since) == expected


def test_since_rejects_what_is_not_iso() -> None:
    with pytest.raises(ValueError):
        since_id("yesterday")


# --- summarize -------------------------------------------------------------------------------

MIXED = [
    record("r1", account="t-a", tier="priority", served_model="big", cost_usd=0.5,
           prompt_tokens=100, completion_tokens=10),
    record("r2", account="t-a", tier="default", served_model="small", cost_usd=0.25,
           prompt_tokens=200, completion_tokens=20, estimated=True),
    record("r3", account="t-b", tier="default", served_model="big", cost_usd=0.125,
           prompt_tokens=300, completion_tokens=30, outcome="error", status=502, source=None),
    record("r4", account="t-a", tier="priority", served_model="big", cost_usd=0.1,
           prompt_tokens=400, completion_tokens=40, outcome="cancelled", status=499,
           estimated=True),
    record("r5", account="t-b", tier="flex", served_model="small", cost_usd=0.2,
           prompt_tokens=500, completion_tokens=50, source="chat"),
]  # fmt: skip


def totals(
    requests: int,
    prompt: int,
    completion: int,
    cost: float,
    estimated: int = 0,
    errors: int = 0,
    cancelled: int = 0,
) -> dict[str, Any]:
    values = [requests, prompt, completion, cost, estimated, errors, cancelled]
    return dict(zip(TOTAL_COLUMNS, values, strict=True))


def test_summarize_by_account() -> None:
    assert summarize(MIXED, ["account"]) == [
        {"account": "t-a", **totals(3, 700, 70, 0.85, estimated=2, cancelled=1)},
        {"account": "t-b", **totals(2, 800, 80, 0.325, errors=1)},
    ]


def test_summarize_by_account_tier_and_model() -> None:
    rows = summarize(MIXED, ["account", "tier", "model"])
    assert rows == [
        {"account": "t-a", "tier": "default", "model": "small",
         **totals(1, 200, 20, 0.25, estimated=1)},
        {"account": "t-a", "tier": "priority", "model": "big",
         **totals(2, 500, 50, 0.6, estimated=1, cancelled=1)},
        {"account": "t-b", "tier": "default", "model": "big",
         **totals(1, 300, 30, 0.125, errors=1)},
        {"account": "t-b", "tier": "flex", "model": "small", **totals(1, 500, 50, 0.2)},
    ]  # fmt: skip


def test_summarize_by_source_keeps_missing_sources_apart() -> None:
    rows = summarize(MIXED, ["source"])
    by_source = {row["source"]: row for row in rows}
    assert set(by_source) == {"batch", "chat", None}
    assert by_source["batch"]["requests"] == 3
    assert by_source[None] == {"source": None, **totals(1, 300, 30, 0.125, errors=1)}


def test_summarize_cost_sums_are_rounded() -> None:
    rows = summarize([record("a", cost_usd=0.1), record("b", cost_usd=0.2)], ["tier"])
    assert rows == [{"tier": "default", **totals(2, 200, 20, 0.3)}]


def test_summarize_grand_total_and_nothing() -> None:
    everything = summarize(MIXED, [])
    assert everything == [totals(5, 1500, 150, 1.175, estimated=2, errors=1, cancelled=1)]
    assert summarize([], ["account"]) == []


# --- export from the real stream -------------------------------------------------------------


async def test_export_jsonl(usage_redis: aioredis.Redis) -> None:
    await add(usage_redis, *MIXED)
    count, text = await exported(usage_redis, "jsonl")
    assert count == 5
    assert jsonl(text) == [r.to_json() for r in MIXED]


async def test_export_csv(usage_redis: aioredis.Redis) -> None:
    items = [record("r1", user="alice", ttft_ms=None, estimated=True), MIXED[2]]
    await add(usage_redis, *items)
    count, text = await exported(usage_redis, "csv")
    assert count == 2
    reader = csv.DictReader(io.StringIO(text))
    assert reader.fieldnames == RECORD_COLUMNS
    rows = list(reader)
    assert [row["request_id"] for row in rows] == ["r1", "r3"]
    assert rows[0]["user"] == "alice"
    assert rows[0]["ttft_ms"] == ""  # None is an empty cell
    assert rows[1]["user"] == ""
    assert rows[1]["source"] == ""
    assert rows[1]["status"] == "502"
    assert rows[1]["outcome"] == "error"
    assert float(rows[1]["cost_usd"]) == 0.125
    assert int(rows[1]["prompt_tokens"]) == 300


async def test_export_of_an_empty_stream(usage_redis: aioredis.Redis) -> None:
    assert await exported(usage_redis, "jsonl") == (0, "")
    count, text = await exported(usage_redis, "csv")
    assert count == 0
    assert text.splitlines() == [",".join(RECORD_COLUMNS)]


async def test_export_summed(usage_redis: aioredis.Redis) -> None:
    await add(usage_redis, *MIXED)
    count, text = await exported(usage_redis, "jsonl", by=["account"])
    assert count == 2
    assert jsonl(text) == summarize(MIXED, ["account"])
    count, text = await exported(usage_redis, "csv", by=["account", "model"])
    assert count == 4
    reader = csv.DictReader(io.StringIO(text))
    assert reader.fieldnames == ["account", "model", *TOTAL_COLUMNS]
    first = next(reader)
    assert (first["account"], first["model"], first["requests"]) == ("t-a", "big", "2")


async def test_export_since(usage_redis: aioredis.Redis) -> None:
    await add(usage_redis, ("1000-0", record("early")), ("5000-0", record("late")))
    assert [r["request_id"] for r in jsonl((await exported(usage_redis, "jsonl"))[1])] == [
        "early",
        "late",
    ]
    for since, expected in [
        ("1970-01-01T00:00:00", ["early", "late"]),
        ("1970-01-01T00:00:01", ["early", "late"]),  # from that millisecond on
        ("1970-01-01T00:00:01.500", ["late"]),
        ("1970-01-01T00:00:03", ["late"]),
        ("1970-01-01T02:00:05+02:00", ["late"]),
        ("1970-01-01T00:00:05.001", []),
    ]:
        count, text = await exported(usage_redis, "jsonl", since=since)
        assert [r["request_id"] for r in jsonl(text)] == expected, since
        assert count == len(expected)


async def test_export_since_sums_only_later_records(usage_redis: aioredis.Redis) -> None:
    await add(
        usage_redis,
        ("1000-0", record("early", cost_usd=1.0)),
        ("5000-0", record("late", cost_usd=0.5)),
        ("5000-1", record("later", cost_usd=0.25)),
    )
    _, text = await exported(usage_redis, "jsonl", since="1970-01-01T00:00:02", by=["account"])
    assert jsonl(text) == [{"account": "t-acme", **totals(2, 200, 20, 0.75)}]


@pytest.mark.parametrize("count", [2, 4, 5])
async def test_records_over_several_batches(
    usage_redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    monkeypatch.setattr(exporter, "BATCH", 2)
    calls: list[dict[str, Any]] = []
    xrange = usage_redis.xrange

    async def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return await xrange(*args, **kwargs)

    monkeypatch.setattr(usage_redis, "xrange", counting)
    items = [record(f"r{i}") for i in range(count)]
    # Two entries in the same millisecond: the next batch must not skip or repeat either.
    await add(usage_redis, *((f"7000-{i}", r) for i, r in enumerate(items)))
    got = [r async for r in records(usage_redis, None)]
    assert got == items
    assert len(calls) == count // 2 + 1
    assert all(c["count"] == 2 for c in calls)

    out = io.StringIO()
    assert await bounded(export(usage_redis, None, "jsonl", None, out)) == count
    assert [r["request_id"] for r in jsonl(out.getvalue())] == [r.request_id for r in items]


async def test_records_since_over_several_batches(
    usage_redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(exporter, "BATCH", 2)
    await add(usage_redis, *((f"{1000 * (i + 1)}-0", record(f"r{i}")) for i in range(6)))
    got = [r.request_id async for r in records(usage_redis, "1970-01-01T00:00:02")]
    assert got == ["r1", "r2", "r3", "r4", "r5"]


# --- CSV cells a spreadsheet would run ---------------------------------------------------------


def test_csv_quotes_strings_a_spreadsheet_would_run_as_formulas() -> None:
    risky = {"eq": "=1+2", "plus": "+cmd", "minus": "-2+3", "at": "@SUM(A1)",
             "tab": "\t=x", "cr": "\r=x"}  # fmt: skip
    plain = {"text": "fine", "inner": "a=b", "empty": None, "neg_int": -3, "neg_float": -1.5,
             "flag": True, "zero": 0}  # fmt: skip
    row = {**risky, **plain}
    out = io.StringIO()
    assert exporter.write_rows([row], list(row), "csv", out) == 1
    [cells] = list(csv.DictReader(io.StringIO(out.getvalue(), newline="")))
    assert {k: cells[k] for k in risky} == {k: "'" + v for k, v in risky.items()}
    assert {k: cells[k] for k in plain} == {
        "text": "fine", "inner": "a=b", "empty": "", "neg_int": "-3", "neg_float": "-1.5",
        "flag": "True", "zero": "0",
    }  # fmt: skip


def test_jsonl_keeps_values_as_they_are() -> None:
    out = io.StringIO()
    exporter.write_rows([{"user": "=1+2", "n": -1}], ["user", "n"], "jsonl", out)
    assert jsonl(out.getvalue()) == [{"user": "=1+2", "n": -1}]


async def test_export_csv_of_a_record_with_a_formula_for_a_user(
    usage_redis: aioredis.Redis,
) -> None:
    await add(usage_redis, record("=rid", user='=HYPERLINK("http://x","y")', source="@x"))
    _, text = await exported(usage_redis, "csv")
    [row] = list(csv.DictReader(io.StringIO(text)))
    assert (row["request_id"], row["user"], row["source"]) == (
        "'=rid",
        '\'=HYPERLINK("http://x","y")',
        "'@x",
    )
    assert row["prompt_tokens"] == "100"
