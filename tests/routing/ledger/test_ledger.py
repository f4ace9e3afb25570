"""Usage records on their way to the stream `usage` (docs/usage.md): appended once per request id,
trimmed to the retention, spooled to disk while Redis is away or refusing, flushed
(idempotently) once it takes them again. The spool's files: tests/routing/ledger/test_spool.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, cast

import orjson
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from gateway.runtime.settings import parse_config
from routing.admission.admit import STORE_ERRORS, Admission, Lease
from routing.admission.plan import plan_candidates
from routing.ledger import records as ledger
from routing.ledger.records import (
    DEDUPE_MAX_S,
    FirstSends,
    StreamStats,
    UsageSettings,
    identity,
    record_call,
    store_sender,
    trim_stream,
)
from routing.ledger.spool import UsageSpool
from routing.registry import Registry
from routing.store.base import Store
from routing.store.connect import RedisPyStore, connect
from routing.store.keys import USAGE_STREAM
from routing.store.resp import RespClient
from routing.store.scripts import Call, Scripts
from tests.conftest import REDIS_URL
from tests.factories import usage_record
from tests.redis_server import RedisServer, StreamEntries


def lean_store() -> RespClient:
    """The hot path's client, on the run's Redis (the `usage_redis` fixture's)."""
    return RespClient(REDIS_URL)


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
DAY_S = 86400.0
T = TypeVar("T")


async def bounded(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, BOUND_S)


def usage_fields(rid: str = RID_PREFIX + "1", **changes: Any) -> dict[str, str]:
    made = usage_record(
        request_id=rid, account="t-ledger", requested_model="m", served_model="m",
        prompt_tokens=10, completion_tokens=5, queue_ms=0.0, ttft_ms=3.25, cost_usd=0.000001,
    )  # fmt: skip
    return {**made.to_fields(), **changes}


def spool_in(directory: Path, url: str = REDIS_URL, max_bytes: int = 1024 * 1024) -> UsageSpool:
    return UsageSpool(UsageSettings(spool_dir=str(directory), spool_max_bytes=max_bytes), url)


def spooled(spool: UsageSpool) -> list[dict[str, str]]:
    if not spool.path.exists():
        return []
    return [orjson.loads(line) for line in spool.path.read_bytes().splitlines() if line.strip()]


async def entries(client: aioredis.Redis) -> list[dict[str, str]]:
    raw = cast(StreamEntries, await client.xrange(USAGE_STREAM))
    return [{k.decode(): v.decode() for k, v in data.items()} for _, data in raw]


async def redis_ms(client: aioredis.Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def admission(
    redis: aioredis.Redis, spool: UsageSpool | None, *, on_outage: str = "reject"
) -> Admission:
    config = parse_config(CONFIG, "t.yaml")
    return Admission(
        RedisPyStore(redis, 2.0),
        Registry(config.models),
        config.tiers,
        lease_ttl_s=30,
        on_outage=on_outage,
        spool=spool,
    )


def lease(lease_id: str = "t-ledger-lease-1") -> Lease:
    return Lease(lease_id, "m", "http://m-a:8000", "gw:v2:acct:{t-ledger}", 0.0)


@pytest.fixture
async def dead_redis() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(DEAD_URL, socket_connect_timeout=0.2, socket_timeout=0.2)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def node_per_entry(tmp_path: Path) -> AsyncIterator[aioredis.Redis]:
    """A private Redis whose stream nodes hold one entry each: trimming with `~` (whole
    nodes) then acts entry by entry, so the entry ids tell exactly what was trimmed."""
    server = RedisServer(tmp_path).start()
    client = aioredis.Redis.from_url(server.url)
    try:
        await client.config_set("stream-node-max-entries", 1)
        yield client
    finally:
        await client.aclose()
        server.stop()


# --- record_call and usage.lua ----------------------------------------------------------------


NOW_TS = "2026-11-30T12:00:01.250+00:00"  # a record's time (its second: NOW_S)
NOW_S = 1796040001


def first_record_call(fields: dict[str, str], retention_s: float) -> Any:
    """A release's first send of `fields`, by a process that never sent a record before."""
    return FirstSends().call(fields, retention_s)


def test_record_call_shape() -> None:
    flat = {"request_id": "r-9", "ts": NOW_TS, "account": "a"}
    name, keys, args = record_call(flat, 35 * DAY_S)
    assert name == "usage"
    bucket = f"{{usage}}:rids:{NOW_S}"
    assert list(keys) == ["usage", bucket]
    forget_at, member, *pairs = args
    assert member == "r-9"
    assert forget_at >= NOW_S * 1000 + DEDUPE_MAX_S * 1000
    assert pairs == ["request_id", "r-9", "ts", NOW_TS, "account", "a"]
    # The first send: the identity in its second's set and the entry, all or none; the
    # set's expiry only with the process's first record of that second.
    first = FirstSends()
    name, keys, (add, expire, xadd) = first.call({**flat, "attempt": "l-1"}, 35 * DAY_S)
    assert (name, list(keys)) == ("MULTI", [])
    assert add == ("SADD", [bucket], ["r-9:l-1"])
    assert expire[:2] == ("PEXPIREAT", [bucket]) and expire[2][0] >= forget_at
    assert xadd[:2] == ("XADD", ["usage"])
    _, _, (add, xadd) = first.call({**flat, "attempt": "l-2"}, 35 * DAY_S)
    assert add == ("SADD", [bucket], ["r-9:l-2"]) and xadd[0] == "XADD"
    first.forget()  # a record did not reach Redis: the next one sets the expiry again
    _, _, commands = first.call({**flat, "attempt": "l-3"}, 35 * DAY_S)
    assert [c[0] for c in commands] == ["SADD", "PEXPIREAT", "XADD"]


def test_ids_are_remembered_no_longer_than_the_retention(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("routing.ledger.records.time.time", lambda: NOW_S + 0.5)
    fields = usage_fields(ts=NOW_TS)
    _, _, short = record_call(fields, 2.5)
    assert short[0] == NOW_S * 1000 + 2500
    _, _, long = record_call(fields, 35 * DAY_S)
    assert long[0] == (NOW_S + DEDUPE_MAX_S) * 1000
    _, _, (_, expire, _) = first_record_call(fields, 2.5)
    assert list(expire[2]) == [NOW_S * 1000 + 2500]
    # A record older than that (a long outage's spool) is remembered that long from now.
    monkeypatch.setattr("routing.ledger.records.time.time", lambda: NOW_S + 3 * DAY_S)
    _, _, late = record_call(fields, DAY_S)
    assert late[0] == (NOW_S + 4 * DAY_S) * 1000


def test_the_identity_is_the_request_id_and_attempt_in_the_set_of_its_second() -> None:
    assert identity({"request_id": "r", "ts": NOW_TS}) == (f"{{usage}}:rids:{NOW_S}", "r")
    fields = {"request_id": "r", "ts": "2026-11-30T12:00:01", "attempt": "a"}  # UTC
    assert identity(fields) == (f"{{usage}}:rids:{NOW_S}", "r:a")


def test_record_call_carries_every_field() -> None:
    flat = usage_fields()
    _, _, args = record_call(flat, DAY_S)
    pairs = list(args)[2:]
    assert dict(zip(pairs[::2], pairs[1::2], strict=True)) == flat
    _, _, (_, _, (_, _, xadd)) = first_record_call(flat, DAY_S)
    pairs = list(xadd)[1:]
    assert dict(zip(pairs[::2], pairs[1::2], strict=True)) == flat


async def remembered_ms(client: aioredis.Redis, fields: dict[str, str]) -> int:
    """How long Redis remembers a recorded identity (ms); -2 when it does not."""
    bucket, member = identity(fields)
    if not await client.sismember(bucket, member):
        return -2
    return int(await client.pttl(bucket))


async def test_usage_script_appends_once_per_request_id(usage_redis: aioredis.Redis) -> None:
    scripts = Scripts()
    flat = usage_fields()
    call = record_call(flat, 35 * DAY_S)
    store = RedisPyStore(usage_redis, 2.0)
    assert await bounded(scripts.send(store, [call])) == [1]
    assert await bounded(scripts.send(store, [call])) == [0]
    assert await entries(usage_redis) == [flat]
    assert await remembered_ms(usage_redis, flat) > (DEDUPE_MAX_S - 60) * 1000
    assert await remembered_ms(usage_redis, flat) <= DEDUPE_MAX_S * 1000


async def test_usage_script_appends_distinct_request_ids(usage_redis: aioredis.Redis) -> None:
    scripts = Scripts()
    first, second = usage_fields(RID_PREFIX + "a"), usage_fields(RID_PREFIX + "b")
    calls = [record_call(first, DAY_S), record_call(second, DAY_S), record_call(first, DAY_S)]
    assert await bounded(scripts.send(RedisPyStore(usage_redis, 2.0), calls)) == [1, 1, 0]
    assert await entries(usage_redis) == [first, second]


async def test_a_reused_request_id_is_still_two_records(usage_redis: aioredis.Redis) -> None:
    """Callers may send the same x-request-id twice: two admissions, two records."""
    scripts = Scripts()
    first = {**usage_fields(), "attempt": "replica-1"}
    second = {**usage_fields(), "attempt": "replica-2"}
    calls = [record_call(first, DAY_S), record_call(second, DAY_S), record_call(first, DAY_S)]
    assert await bounded(scripts.send(RedisPyStore(usage_redis, 2.0), calls)) == [1, 1, 0]


@pytest.mark.parametrize("lean", [True, False], ids=["resp", "redis-py"])
async def test_a_first_send_and_its_resends_make_one_entry(
    usage_redis: aioredis.Redis, lean: bool
) -> None:
    """The release sends a record once, as a transaction; the spool's resends (its reply was
    lost) and a lost master's records go through the script, which finds the identity."""
    scripts = Scripts()
    store = lean_store() if lean else RedisPyStore(usage_redis, 2.0)
    flat = {**usage_fields(), "attempt": "lease-1"}
    try:
        (first,) = await bounded(scripts.send(store, [first_record_call(flat, 35 * DAY_S)]))
        assert first[0] == 1 and first[2]  # EXEC's replies: SADD, PEXPIREAT, XADD's id
        assert await bounded(scripts.send(store, [record_call(flat, 35 * DAY_S)])) == [0]
        assert await entries(usage_redis) == [flat]
        assert await remembered_ms(usage_redis, flat) > (DEDUPE_MAX_S - 60) * 1000
    finally:
        await store.aclose()


async def test_a_refused_first_send_writes_nothing(usage_redis: aioredis.Redis) -> None:
    """A command Redis refuses while queuing the transaction (OOM at maxmemory, MOVED; here a
    wrong argument count) aborts it whole: no identity is left to hide the record from its
    resend, and the connection stays in step for the calls after it."""
    scripts, store = Scripts(), lean_store()
    flat = usage_fields()
    _, _, (add, expire, _) = first_record_call(flat, DAY_S)
    broken: Call = ("MULTI", [], [add, expire, ("XADD", [USAGE_STREAM], [])])
    try:
        reply, pong = await bounded(scripts.send(store, [broken, ("PING", [], [])]))
        assert pong in (b"PONG", "PONG")
        assert isinstance(reply, ResponseError) and "xadd" in str(reply).lower()
        assert await remembered_ms(usage_redis, flat) == -2
        assert await bounded(scripts.send(store, [record_call(flat, DAY_S)])) == [1]
    finally:
        await store.aclose()


# --- the spool round: trimming and the stream's gauges ----------------------------------------


async def test_round_trims_and_reads_length_and_oldest_age(node_per_entry: aioredis.Redis) -> None:
    redis = node_per_entry
    send = store_sender(Scripts(), RedisPyStore(redis, 2.0))
    assert await bounded(trim_stream(send, DAY_S)) == StreamStats(0, 0.0)

    now = await redis_ms(redis)
    await redis.xadd(USAGE_STREAM, {"old": "1"}, id=f"{now - int(3 * DAY_S * 1000)}-0")
    await redis.xadd(USAGE_STREAM, {"recent": "1"}, id=f"{now - 5_000}-0")
    stats = await bounded(trim_stream(send, 35 * DAY_S))
    assert stats.length == 2
    assert 3 * DAY_S <= stats.oldest_age_s < 3 * DAY_S + 600

    # An idle fleet trims too: no append needed, the round does it.
    stats = await bounded(trim_stream(send, DAY_S))
    assert stats.length == 1
    assert 5.0 <= stats.oldest_age_s < 600
    assert [i.decode() for i, _ in cast(StreamEntries, await redis.xrange(USAGE_STREAM))] == [
        f"{now - 5_000}-0"
    ]


async def test_spool_round_trims_and_stores_the_stream_stats(
    node_per_entry: aioredis.Redis, tmp_path: Path
) -> None:
    settings = UsageSettings(spool_dir=str(tmp_path), retention_days=0.00002)
    spool = UsageSpool(settings, "redis://127.0.0.1:1/0")
    await node_per_entry.xadd(USAGE_STREAM, {"old": "1"}, id="1-0")
    spool.add(usage_fields())
    assert spool.stream is None
    await bounded(spool.tend(store_sender(Scripts(), RedisPyStore(node_per_entry, 2.0))))
    assert spool.stream is not None and spool.stream.length == 1
    assert await entries(node_per_entry) == [usage_fields()]
    assert not spool.pending()


async def test_spool_round_on_the_in_process_store(tmp_path: Path) -> None:
    """memory:// (`gateway demo`): the same scripts and round on fakeredis."""
    store = connect("memory://", command_timeout_s=2.0)
    spool = spool_in(tmp_path, "memory://")
    spool.add(usage_fields())
    await bounded(spool.tend(store_sender(Scripts(), RedisPyStore(store, None))))
    assert await entries(store) == [usage_fields()]
    assert spool.stream is not None and spool.stream.length == 1
    assert not spool.pending()


# --- store_sender: one reply per call ----------------------------------------------------------


@pytest.mark.parametrize("lean", [True, False], ids=["resp", "redis-py"])
async def test_sender_returns_error_replies_in_place(
    usage_redis: aioredis.Redis, lean: bool
) -> None:
    store: Store = RespClient(REDIS_URL) if lean else RedisPyStore(usage_redis, 2.0)
    scripts = Scripts()
    send = store_sender(scripts, store)
    await usage_redis.set("gw:t-ledger:not-a-stream", "x")
    calls = [
        record_call(usage_fields(RID_PREFIX + "a"), DAY_S),
        ("XLEN", ["gw:t-ledger:not-a-stream"], []),
        record_call(usage_fields(RID_PREFIX + "b"), DAY_S),
    ]
    # Redis forgot its scripts (a restart): the sender loads them and sends again.
    await usage_redis.script_flush()
    first, wrong, second = await bounded(send(calls))
    assert (first, second) == (1, 1)
    assert isinstance(wrong, ResponseError)
    assert await bounded(send(calls[:1])) == [0]
    assert [e["request_id"] for e in await entries(usage_redis)] == [
        RID_PREFIX + "a",
        RID_PREFIX + "b",
    ]
    await store.aclose()


async def test_sender_raises_when_redis_is_away(dead_redis: aioredis.Redis) -> None:
    send = store_sender(Scripts(), RedisPyStore(dead_redis, 2.0))
    with pytest.raises(STORE_ERRORS):
        await bounded(send([("XLEN", [USAGE_STREAM], [])]))


# --- a full Redis (maxmemory, noeviction): refused, spooled, sent once there is room ----------


async def test_records_wait_in_the_spool_while_redis_is_full(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, maxmemory="2mb").start()
    client = aioredis.Redis.from_url(server.url)
    try:
        filler = await fill(client)
        spool = spool_in(tmp_path / "spool", server.url)
        send = store_sender(Scripts(), RedisPyStore(client, 2.0))
        flat = usage_fields()
        assert spool.add(flat)
        # Refused (OOM, before it wrote anything): kept, and the next round tries again.
        assert await bounded(spool.flush(send)) == 0
        assert await bounded(spool.flush(send)) == 0
        assert spooled(spool) == [flat]
        assert await client.exists(identity(flat)[0]) == 0
        # The round still trims and measures at maxmemory (XTRIM frees, it is not refused).
        await bounded(spool.tend(send))
        assert spool.stream is not None and spool.stream.length == 0

        await client.delete(*filler)
        await bounded(spool.tend(send))
        assert await entries(client) == [flat]
        assert not spool.pending()
        await bounded(spool.tend(send))
        assert await entries(client) == [flat]
    finally:
        await client.aclose()
        server.stop()


async def fill(client: aioredis.Redis) -> list[str]:
    """Put a Redis 2 MB past its 2 MB maxmemory: a script may go on writing once it has
    written (here a DEL), so noeviction then refuses every new denyoom write, not just the
    one that happened to cross the line."""
    script = (
        "redis.call('DEL', 'filler:none') "
        "for i = 1, 200 do redis.call('SET', 'filler:' .. i, string.rep('x', 10000)) end"
    )
    await client.eval(script, 0)
    with pytest.raises(ResponseError, match="maxmemory"):
        await client.set("probe", "x")
    return [f"filler:{i}" for i in range(1, 201)]


# --- Admission: release with the record, spool, flush -----------------------------------------


async def test_release_appends_the_record(usage_redis: aioredis.Redis, tmp_path: Path) -> None:
    spool = spool_in(tmp_path)
    adm = admission(usage_redis, spool)
    flat = usage_fields()
    await bounded(adm.release(lease(), flat))
    assert await entries(usage_redis) == [{**flat, "attempt": "t-ledger-lease-1"}]
    assert not spool.pending()
    await bounded(adm.close())


async def test_release_sends_slot_account_and_record_in_one_round_trip(
    usage_redis: aioredis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = spool_in(tmp_path)
    adm = admission(usage_redis, spool)
    registry = Registry(parse_config(CONFIG, "t.yaml").models)
    candidates = plan_candidates("m", None, fail_fast=False, registry=registry, allowed=None)
    admitted = await bounded(adm.admit(candidates, "t-ledger", 10))
    assert await usage_redis.zcard("gw:v2:{m}:leases") == 1
    assert await usage_redis.zcard(admitted.lease.account) == 1

    sent: list[list[str]] = []
    send = adm.scripts.send

    def spy(store: Any, calls: Any) -> Any:
        sent.append([name for name, _, _ in calls])
        return send(store, calls)

    monkeypatch.setattr(adm.scripts, "send", spy)
    flat = usage_fields()
    await bounded(adm.release(admitted.lease, flat))
    assert sent == [["release", "MULTI"]]  # the account entry goes with the slot (one Redis)
    assert await usage_redis.zcard("gw:v2:{m}:leases") == 0
    assert await usage_redis.zcard(admitted.lease.account) == 0
    assert await entries(usage_redis) == [{**flat, "attempt": admitted.lease.id}]
    assert not spool.pending()
    await bounded(adm.close())


async def test_release_of_a_local_lease_spools_the_record(
    usage_redis: aioredis.Redis, tmp_path: Path
) -> None:
    spool = spool_in(tmp_path)
    adm = admission(usage_redis, spool, on_outage="local")
    local = Lease("t-ledger-local", "m", "", "gw:v2:acct:{t-ledger}", 0.0, local=True)
    adm.holdings.held[local.id] = local
    flat = usage_fields()
    await bounded(adm.release(local, flat))
    assert spooled(spool) == [{**flat, "attempt": "t-ledger-local"}]
    assert await entries(usage_redis) == []
    assert await bounded(adm.ledger.flush()) == 1
    assert await entries(usage_redis) == [{**flat, "attempt": "t-ledger-local"}]
    await bounded(adm.close())


async def test_release_spools_the_record_when_redis_is_down(
    dead_redis: aioredis.Redis, usage_redis: aioredis.Redis, tmp_path: Path
) -> None:
    spool = spool_in(tmp_path)
    dead = admission(dead_redis, spool)
    flat = usage_fields()
    await bounded(dead.release(lease(), flat))  # never an error
    assert spooled(spool) == [{**flat, "attempt": "t-ledger-lease-1"}]
    await bounded(dead.close())

    live = admission(usage_redis, spool)
    assert await bounded(live.ledger.flush()) == 1
    sent = {**flat, "attempt": "t-ledger-lease-1"}
    assert await entries(usage_redis) == [sent]
    assert not spool.pending()

    # A flush that resends the same record (e.g. the spool rewrite failed) adds nothing.
    spool.add(sent)
    assert await bounded(live.ledger.flush()) == 1
    assert await entries(usage_redis) == [sent]
    assert not spool.pending()
    assert await bounded(live.ledger.flush()) == 0
    await bounded(live.close())


async def test_release_without_usage_spools_nothing(
    dead_redis: aioredis.Redis, tmp_path: Path
) -> None:
    spool = spool_in(tmp_path)
    dead = admission(dead_redis, spool)
    await bounded(dead.release(lease()))
    assert not spool.pending()
    await bounded(dead.close())


async def test_flush_fails_while_redis_is_down_and_keeps_the_spool(
    dead_redis: aioredis.Redis, tmp_path: Path
) -> None:
    spool = spool_in(tmp_path)
    spool.add(usage_fields())
    dead = admission(dead_redis, spool)
    with pytest.raises(STORE_ERRORS):
        await bounded(dead.ledger.flush())
    assert spooled(spool) == [usage_fields()]
    await bounded(dead.close())


async def test_flush_without_spool_does_nothing(usage_redis: aioredis.Redis) -> None:
    live = admission(usage_redis, None)
    assert await bounded(live.ledger.flush()) == 0
    assert await entries(usage_redis) == []
    await bounded(live.close())


def test_a_records_second_is_the_same_read_afresh_or_remembered() -> None:
    """`_second_of` remembers the last second it read by its text; a record of another
    offset, or none, with the same digits is still read for what it says."""
    base = int(datetime(2026, 12, 1, 21, 40, tzinfo=UTC).timestamp())
    cases = [
        ("2026-12-01T21:40:00.123+00:00", base),
        ("2026-12-01T21:40:00.999+00:00", base),  # remembered
        ("2026-12-01T21:40:00.123+02:00", base - 7200),
        ("2026-12-01T21:40:00.500+00:00", base),
        ("2026-12-01T21:40:00.500", base),  # no offset: UTC
        ("2026-12-01T21:40:00+00:00", base),
        ("2026-12-01T21:40:01.000+00:00", base + 1),
        ("2026-12-01T21:40:00.001+00:00", base),
    ]
    for ts, second in cases:
        assert ledger._second_of(ts) == second, ts
    before = int(time.time())
    assert before <= ledger._second_of("not a time") <= int(time.time())
