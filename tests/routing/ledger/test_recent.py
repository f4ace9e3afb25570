"""After the store moves to another master (Sentinel), the usage records the old master
took lately are sent again: Redis replicates asynchronously, so the promoted replica may
never have got them. A record the new master has is not counted twice."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.runtime.settings import parse_config
from routing.admission.admit import Admission
from routing.admission.keeper import Keeper
from routing.admission.plan import plan_candidates
from routing.ledger.recent import Recent
from routing.ledger.records import UsageSettings, record_call
from routing.ledger.spool import UsageSpool
from routing.registry import Registry
from routing.store.keys import USAGE_STREAM
from routing.store.resp import RespClient
from tests.redis_server import RedisServer
from tests.routing.servers import Locator

CONFIG = 'models: {m: {endpoints: [{url: "http://127.0.0.1:9", max_concurrency: 4}]}}\n'
REGISTRY = Registry(parse_config(CONFIG, "recent.yaml").models)


@pytest.fixture
async def moving(
    two: tuple[RedisServer, RedisServer], tmp_path: Path
) -> AsyncIterator[tuple[Admission, Locator]]:
    locator = Locator(two[0].port)
    store = RespClient("redis://master/0", locator=locator, watch_s=0.02)
    config = parse_config(CONFIG, "recent.yaml")
    spool = UsageSpool(UsageSettings(spool_dir=str(tmp_path)), "redis+sentinel://s/gw")
    adm = Admission(store, REGISTRY, config.tiers, lease_ttl_s=30,
                    on_outage="reject", spool=spool)  # fmt: skip
    try:
        yield adm, locator
    finally:
        await asyncio.wait_for(adm.close(), 5)
        await store.aclose()
        spool.close()


def records_on(server: RedisServer) -> list[str]:
    with redis.Redis(port=server.port) as plain:
        return [fields[b"request_id"].decode() for _, fields in plain.xrange(USAGE_STREAM)]


async def admit_and_release(adm: Admission, rid: str) -> None:
    plan = plan_candidates("m", None, fail_fast=True, registry=REGISTRY, allowed=None)
    admitted = await asyncio.wait_for(adm.admit(plan, "acct", 10), 5)
    # A record carries its time, as the gateway's do: its identity is remembered in the set
    # of that second, so a resend a second boundary later still finds it.
    ts = datetime.now(UTC).isoformat()
    record = {"request_id": rid, "account": "acct", "status": "200", "ts": ts}
    await asyncio.wait_for(adm.release(admitted.lease, record), 5)


def seconds_later(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The clock the ledger reads, moved on: the resends below cross a second boundary."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)


async def test_records_the_old_master_took_go_again_to_the_new_one(
    two: tuple[RedisServer, RedisServer],
    moving: tuple[Admission, Locator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    adm, locator = moving
    for i in range(3):
        await admit_and_release(adm, f"before-move-{i}")
    assert records_on(two[0]) == [f"before-move-{i}" for i in range(3)]
    # The new master got the first one before the failover, as a replica would have.
    assert adm.handback.recent is not None
    replicated = adm.handback.recent.lately()[0]
    other = RespClient(f"redis://127.0.0.1:{two[1].port}/0")
    try:
        await asyncio.wait_for(adm.scripts.send(other, [record_call(replicated, 3600)]), 5)
    finally:
        await other.aclose()
    assert records_on(two[1]) == ["before-move-0"]
    locator.port = two[1].port  # the sentinels now name the other master
    deadline = time.monotonic() + 10
    while adm.store.moves == 0:  # its watch runs every 20 ms: a bounded poll for it
        assert time.monotonic() < deadline, "the store never moved"
        with contextlib.suppress(RedisConnectionError):
            await adm.store.send([["PING"]])
        await asyncio.sleep(0.02)
    seconds_later(monkeypatch, 1.0)
    keeper = Keeper(adm, aioredis.Redis(port=two[1].port))
    await asyncio.wait_for(keeper._tend_spool(), 5)
    assert sorted(records_on(two[1])) == [f"before-move-{i}" for i in range(3)]
    await asyncio.wait_for(keeper._tend_spool(), 5)  # nothing more, nothing twice
    assert len(records_on(two[1])) == 3


def test_recent_keeps_only_the_last_seconds_and_a_bounded_number() -> None:
    now = [0.0]
    recent = Recent(keep_s=10.0, most=3, clock=lambda: now[0])
    for i in range(5):
        now[0] = float(i)
        recent.took({"request_id": str(i)})
    assert [r["request_id"] for r in recent.lately()] == ["2", "3", "4"]  # at most 3
    now[0] = 13.5
    assert [r["request_id"] for r in recent.lately()] == ["4"]  # 10 s at most


def test_a_store_that_cannot_move_keeps_no_records() -> None:
    store = RespClient("redis://127.0.0.1:1/0")
    assert store.moves is None


async def test_records_sent_from_the_spool_are_kept_as_recent_too(
    two: tuple[RedisServer, RedisServer], moving: tuple[Admission, Locator]
) -> None:
    adm, _ = moving
    spool, recent = adm.ledger.spool, adm.handback.recent
    assert spool is not None and recent is not None
    ts = datetime.now(UTC).isoformat()
    spool.add({"request_id": "spooled", "account": "acct", "status": "200", "ts": ts})
    assert "spooled" not in [r["request_id"] for r in recent.lately()]
    keeper = Keeper(adm, aioredis.Redis(port=two[0].port))
    await asyncio.wait_for(keeper._tend_spool(), 5)
    assert records_on(two[0]) == ["spooled"]
    # The old master took it from the spool: a move now sends it again, as a release's.
    assert [r["request_id"] for r in recent.lately()] == ["spooled"]


async def test_a_release_answered_after_a_move_spools_its_record_again(
    moving: tuple[Admission, Locator],
) -> None:
    adm, _ = moving
    spool = adm.ledger.spool
    assert spool is not None and adm.store.moves == 0
    plan = plan_candidates("m", None, fail_fast=True, registry=REGISTRY, allowed=None)
    admitted = await asyncio.wait_for(adm.admit(plan, "acct", 10), 5)
    record = {"request_id": "late", "account": "acct", "status": "200"}
    released = adm.release(admitted.lease, record)
    # The store moves while the answer is on its way: the keeper may already have sent the
    # recent records again, so this one, taken by the old master, is spooled once more.
    adm.store.moves = 1
    await asyncio.wait_for(released, 5)
    assert spool.pending()
