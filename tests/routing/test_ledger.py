"""Usage records on their way to the stream `usage` (SPEC 7): appended once per request id,
spooled to disk while Redis is away, flushed (idempotently) once it answers again."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest
import redis.asyncio as aioredis

from gateway.settings import parse_config
from routing.admission import STORE_ERRORS, Admission, Lease
from routing.ledger import REMEMBER_S, USAGE_STREAM, UsageSettings, UsageSpool, record_call
from routing.plan import plan_candidates
from routing.registry import Registry
from routing.scripts import Scripts
from tests.factories import usage_record
from tiers.policy import Tier

CONFIG = """
models:
  m:
    tiers: [default, priority, flex]
    endpoints:
      - {url: "http://m-a:8000", max_concurrency: 2}
"""
DEAD_URL = "redis://127.0.0.1:1/0"  # nothing listens there
RID_PREFIX = "t-ledger-"
BOUND_S = 5.0
T = TypeVar("T")


async def bounded(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, BOUND_S)


def usage_fields(rid: str = RID_PREFIX + "1", **changes: Any) -> dict[str, str]:
    made = usage_record(
        request_id=rid, account="t-ledger", requested_model="m", served_model="m",
        prompt_tokens=10, completion_tokens=5, queue_ms=0.0, ttft_ms=3.25, cost_usd=0.000001,
    )  # fmt: skip
    return {**made.to_fields(), **changes}


def spool_at(path: Path, max_bytes: int = 1024 * 1024) -> UsageSpool:
    spool = UsageSpool(UsageSettings(spool_dir=str(path.parent), spool_max_bytes=max_bytes))
    spool.path = path
    return spool


async def entries(client: aioredis.Redis) -> list[dict[str, str]]:
    raw = await client.xrange(USAGE_STREAM)
    return [{k.decode(): v.decode() for k, v in data.items()} for _, data in raw]


def admission(
    redis: aioredis.Redis, spool: UsageSpool | None, *, on_outage: str = "reject"
) -> Admission:
    config = parse_config(CONFIG, "t.yaml")
    return Admission(
        redis,
        Registry(config.models),
        config.tiers,
        lease_ttl_s=30,
        on_outage=on_outage,
        store=None,
        spool=spool,
    )


def lease(lease_id: str = "t-ledger-lease-1") -> Lease:
    return Lease(lease_id, "m", "http://m-a:8000", "gw:acct:{t-ledger}", 0.0)


@pytest.fixture
async def dead_redis() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(DEAD_URL, socket_connect_timeout=0.2, socket_timeout=0.2)
    try:
        yield client
    finally:
        await client.aclose()


# --- record_call -----------------------------------------------------------------------------


def test_record_call_shape() -> None:
    flat = {"request_id": "r-9", "account": "a", "user": ""}
    name, keys, args = record_call(flat)
    assert name == "usage"
    assert list(keys) == ["usage", "{usage}:rid:r-9"]
    assert list(args) == [REMEMBER_S, "request_id", "r-9", "account", "a", "user", ""]


def test_record_call_carries_every_field() -> None:
    flat = usage_fields()
    _, _, args = record_call(flat)
    pairs = list(args)[1:]
    assert dict(zip(pairs[::2], pairs[1::2], strict=True)) == flat


async def test_usage_script_appends_once_per_request_id(usage_redis: aioredis.Redis) -> None:
    scripts = Scripts()
    flat = usage_fields()
    call = record_call(flat)
    assert await bounded(scripts.execute(usage_redis, [call])) == [1]
    assert await bounded(scripts.execute(usage_redis, [call])) == [0]
    assert await entries(usage_redis) == [flat]
    ttl = await usage_redis.ttl("{usage}:rid:" + flat["request_id"])
    assert 0 < ttl <= REMEMBER_S


async def test_usage_script_appends_distinct_request_ids(usage_redis: aioredis.Redis) -> None:
    scripts = Scripts()
    first, second = usage_fields(RID_PREFIX + "a"), usage_fields(RID_PREFIX + "b")
    calls = [record_call(first), record_call(second), record_call(first)]
    assert await bounded(scripts.execute(usage_redis, calls)) == [1, 1, 0]
    assert await entries(usage_redis) == [first, second]


# --- UsageSpool ------------------------------------------------------------------------------


def test_spool_starts_empty(tmp_path: Path) -> None:
    spool = spool_at(tmp_path / "spool.jsonl")
    assert not spool.pending()
    assert spool.lost == 0


def test_spool_add_then_take(tmp_path: Path) -> None:
    path = tmp_path / "spool.jsonl"
    spool = spool_at(path)
    first, second = usage_fields(RID_PREFIX + "1"), usage_fields(RID_PREFIX + "2")
    assert spool.add(first)
    assert spool.add(second)
    assert spool.pending()
    records, size = spool.take()
    assert records == [first, second]
    assert size == path.stat().st_size
    # Taking does not remove: only `done` does.
    assert spool.pending()
    assert spool.take() == (records, size)


def test_spool_lines_are_json_objects(tmp_path: Path) -> None:
    path = tmp_path / "spool.jsonl"
    spool = spool_at(path)
    spool.add(usage_fields())
    lines = path.read_bytes().splitlines()
    assert [orjson.loads(line) for line in lines] == [usage_fields()]


def test_spool_done_drops_only_what_was_taken(tmp_path: Path) -> None:
    spool = spool_at(tmp_path / "spool.jsonl")
    first, second, later = (usage_fields(RID_PREFIX + n) for n in ("1", "2", "3"))
    spool.add(first)
    spool.add(second)
    records, size = spool.take()
    assert records == [first, second]
    spool.add(later)  # added while the taken ones were being flushed
    spool.done(size)
    assert spool.pending()
    assert spool.take()[0] == [later]
    spool.done(spool.take()[1])
    assert not spool.pending()


def test_spool_done_with_everything_taken_empties_it(tmp_path: Path) -> None:
    spool = spool_at(tmp_path / "spool.jsonl")
    spool.add(usage_fields())
    spool.done(spool.take()[1])
    assert not spool.pending()
    assert spool.take() == ([], 0)


def test_full_spool_refuses_and_counts_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "spool.jsonl"
    spool = spool_at(path, max_bytes=1024)
    line = len(orjson.dumps(usage_fields())) + 1
    fits = 1024 // line
    assert fits >= 1
    added = [usage_fields(f"{RID_PREFIX}{i:03d}") for i in range(fits)]
    assert all(spool.add(r) for r in added)
    assert spool.lost == 0
    with caplog.at_level("ERROR", logger="gateway.usage"):
        assert not spool.add(usage_fields(RID_PREFIX + "over"))
        assert not spool.add(usage_fields(RID_PREFIX + "over2"))
    assert spool.lost == 2
    assert path.stat().st_size <= 1024
    assert spool.take()[0] == added
    assert sum("spool full" in r.getMessage() for r in caplog.records) == 2


def test_spool_has_room_again_after_done(tmp_path: Path) -> None:
    spool = spool_at(tmp_path / "spool.jsonl", max_bytes=1024)
    ids = itertools.count()
    while spool.add(usage_fields(f"{RID_PREFIX}{next(ids)}")):
        pass
    assert spool.lost == 1
    spool.done(spool.take()[1])
    assert spool.add(usage_fields(RID_PREFIX + "again"))
    assert spool.lost == 1


def test_unwritable_spool_counts_lost(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    spool = spool_at(tmp_path / "a-file" / "spool.jsonl")
    assert not spool.add(usage_fields())
    assert spool.lost == 1
    assert not spool.pending()


# --- Admission: release with the record, spool, flush -----------------------------------------


async def test_release_appends_the_record(usage_redis: aioredis.Redis, tmp_path: Path) -> None:
    spool = spool_at(tmp_path / "spool.jsonl")
    adm = admission(usage_redis, spool)
    flat = usage_fields()
    await bounded(adm.release(lease(), flat))
    assert await entries(usage_redis) == [{**flat, "attempt": "t-ledger-lease-1"}]
    assert not spool.pending()
    await bounded(adm.close())


async def test_release_sends_slot_account_and_record_in_one_round_trip(
    usage_redis: aioredis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = spool_at(tmp_path / "spool.jsonl")
    adm = admission(usage_redis, spool)
    registry = Registry(parse_config(CONFIG, "t.yaml").models)
    candidates = plan_candidates("m", None, fail_fast=False, registry=registry, allowed=None)
    admitted = await bounded(adm.admit(candidates, lambda _m: Tier.DEFAULT, "t-ledger", 10))
    assert await usage_redis.zcard("gw:{m}:leases") == 1
    assert await usage_redis.zcard(admitted.lease.account) == 1

    sent: list[list[str]] = []
    submit = adm.scripts.submit

    def spy(client: Any, calls: Any) -> Any:
        sent.append([name for name, _, _ in calls])
        return submit(client, calls)

    monkeypatch.setattr(adm.scripts, "submit", spy)
    flat = usage_fields()
    await bounded(adm.release(admitted.lease, flat))
    assert sent == [["release", "ZREM", "usage"]]
    assert await usage_redis.zcard("gw:{m}:leases") == 0
    assert await usage_redis.zcard(admitted.lease.account) == 0
    assert await entries(usage_redis) == [{**flat, "attempt": admitted.lease.id}]
    assert not spool.pending()
    await bounded(adm.close())


async def test_release_of_a_local_lease_spools_the_record(
    usage_redis: aioredis.Redis, tmp_path: Path
) -> None:
    spool = spool_at(tmp_path / "spool.jsonl")
    adm = admission(usage_redis, spool, on_outage="local")
    local = Lease("t-ledger-local", "m", "", "gw:acct:{t-ledger}", 0.0, local=True)
    adm.holdings.held[local.id] = local
    flat = usage_fields()
    await bounded(adm.release(local, flat))
    assert spool.take()[0] == [{**flat, "attempt": "t-ledger-local"}]
    assert await entries(usage_redis) == []
    assert await bounded(adm.flush_spool()) == 1
    assert await entries(usage_redis) == [{**flat, "attempt": "t-ledger-local"}]
    await bounded(adm.close())


async def test_release_spools_the_record_when_redis_is_down(
    dead_redis: aioredis.Redis, usage_redis: aioredis.Redis, tmp_path: Path
) -> None:
    spool = spool_at(tmp_path / "spool.jsonl")
    dead = admission(dead_redis, spool)
    flat = usage_fields()
    assert await bounded(dead.release(lease(), flat)) is None  # never an error
    assert spool.take()[0] == [{**flat, "attempt": "t-ledger-lease-1"}]
    await bounded(dead.close())

    live = admission(usage_redis, spool)
    assert await bounded(live.flush_spool()) == 1
    sent = {**flat, "attempt": "t-ledger-lease-1"}
    assert await entries(usage_redis) == [sent]
    assert not spool.pending()

    # A flush that resends the same record (e.g. the spool rewrite failed) adds nothing.
    spool.add(sent)
    assert await bounded(live.flush_spool()) == 1
    assert await entries(usage_redis) == [sent]
    assert not spool.pending()
    assert await bounded(live.flush_spool()) == 0
    await bounded(live.close())


async def test_release_without_usage_spools_nothing(
    dead_redis: aioredis.Redis, tmp_path: Path
) -> None:
    spool = spool_at(tmp_path / "spool.jsonl")
    dead = admission(dead_redis, spool)
    await bounded(dead.release(lease()))
    assert not spool.pending()
    await bounded(dead.close())


async def test_flush_fails_while_redis_is_down_and_keeps_the_spool(
    dead_redis: aioredis.Redis, tmp_path: Path
) -> None:
    spool = spool_at(tmp_path / "spool.jsonl")
    spool.add(usage_fields())
    dead = admission(dead_redis, spool)
    with pytest.raises(STORE_ERRORS):
        await bounded(dead.flush_spool())
    assert spool.take()[0] == [usage_fields()]
    await bounded(dead.close())


async def test_flush_sends_in_batches(
    usage_redis: aioredis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("routing.admission.FLUSH_BATCH", 2)
    spool = spool_at(tmp_path / "spool.jsonl")
    spooled = [usage_fields(f"{RID_PREFIX}{i}") for i in range(5)]
    for flat in spooled:
        spool.add(flat)
    live = admission(usage_redis, spool)
    assert await bounded(live.flush_spool()) == 5
    assert await entries(usage_redis) == spooled
    assert not spool.pending()
    await bounded(live.close())


async def test_flush_without_spool_does_nothing(usage_redis: aioredis.Redis) -> None:
    live = admission(usage_redis, None)
    assert await bounded(live.flush_spool()) == 0
    assert await entries(usage_redis) == []
    await bounded(live.close())


async def test_a_reused_request_id_is_still_two_records(
    usage_redis: aioredis.Redis,
) -> None:
    """Callers may send the same x-request-id twice: two admissions, two records."""
    scripts = Scripts()
    first = {**usage_fields(), "attempt": "replica-1"}
    second = {**usage_fields(), "attempt": "replica-2"}
    calls = [record_call(first), record_call(second), record_call(first)]
    assert await bounded(scripts.execute(usage_redis, calls)) == [1, 1, 0]
