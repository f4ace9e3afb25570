"""The keeper's rounds across replicas and faults, for what tests/routing/admission/test_keeper.py
does not cover: the accounts' keeps when sweeps run late or a Cluster node restarts empty
(routing/admission/accountkeeps.py), and the local outage shares when a waiter is woken
before its acquire is answered (holdings.py `pending_by_model`); against the run's Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

from gateway.runtime.settings import parse_config
from routing.admission.accountkeeps import RECENT
from routing.admission.admit import Admission
from routing.admission.slots import QUEUED
from routing.errors import Limited
from routing.registry import Registry
from routing.store.connect import connect
from routing.store.keys import REPLICAS_KEY, account_key
from routing.store.resp import RespClient
from tests.conftest import REDIS_URL
from tests.redis_cluster import start_cluster
from tests.routing.admission.test_admission import (
    CONFIG,
    Fleet,
    admit,
    bounded,
    expect_limited,
    intercept,
    release_all,
)
from tests.routing.admission.test_keeper import keeper_of


@pytest.fixture
async def fleet(real_redis: aioredis.Redis) -> AsyncIterator[Fleet]:
    config = parse_config(CONFIG, "t.yaml")
    built = Fleet(config, Registry(config.models), real_redis)
    try:
        yield built
    finally:
        await built.close()


async def test_the_local_shares_add_up_when_a_waiter_is_woken_before_its_acquire_is_answered(
    fleet: Fleet,
) -> None:
    """A waiter registers before its acquire leaves, so its wake-up may come before the
    acquire's reply: the id is then both an acquire not answered yet and a waiter woken. A
    sweep run then must count its one lease once among this replica's (`mine`), or the
    replicas' local shares add up to more than the capacity."""
    a = await fleet.admission(on_outage="local")
    b = await fleet.admission(on_outage="local")
    sweep_a, sweep_b = keeper_of(fleet, a), keeper_of(fleet, b)
    held = [(await admit(b, fleet.plan("five"))).lease for _ in range(5)]  # capacity 5
    await bounded(sweep_a.sweep_once())
    await bounded(sweep_b.sweep_once())  # both alive: each sees the other from now on
    swept = False

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        nonlocal swept
        replies = await send()
        for (name, _, args), reply in zip(calls, replies, strict=True):
            if name == "acquire" and int(reply[0]) == QUEUED and not swept:
                swept = True
                waiter = a.holdings.waiters[str(args[0])]
                # b's release grants a's waiter; its wake-up is read before the reply is.
                await bounded(b.release(held.pop()))
                # Its wake-up message, as the subscription reads it.
                granted = await fleet.member("five", str(args[0]))
                assert granted is not None
                sweep_a.wake(str(args[0]), granted.split(" ")[1])
                assert waiter.future.done()
                assert str(args[0]) in a.holdings.acquiring
                await bounded(sweep_a.sweep_once())  # the waiter woken, its acquire unanswered
        return replies

    intercept(a, around)
    lease = (await admit(a, fleet.plan("five"))).lease
    await bounded(sweep_b.sweep_once())
    assert swept
    assert sweep_a.states["five"].inflight == sweep_b.states["five"].inflight == 5
    limits = [a.local.limit("five"), b.local.limit("five")]  # 5 held, none free: 1 + 4
    assert sum(limits) <= 5, limits
    await release_all(a, [lease])
    await release_all(b, held)
    await fleet.assert_clean()


async def short_lived(fleet: Fleet, lease_ttl_s: float, sweep_interval_s: float) -> Admission:
    """A replica on the run's Redis whose leases and account entries live `lease_ttl_s`."""
    adm = Admission(
        RespClient(REDIS_URL, connect_timeout_s=0.5), fleet.registry, fleet.config.tiers,
        lease_ttl_s=lease_ttl_s, on_outage="reject", sweep_interval_s=sweep_interval_s,
    )  # fmt: skip
    await bounded(adm.start())
    fleet._admissions.append(adm)
    return adm


@pytest.mark.slow
async def test_an_account_entry_outlives_sweeps_that_run_late(fleet: Fleet) -> None:
    """Sweeps run later than their interval (a Redis slow to answer, a busy loop: each round
    starts an interval after the last ended): an account's entry must still be kept within
    its TTL while its request runs, or a second request of an account at its limit (here 1)
    is admitted on another replica."""
    ttl_s, interval_s, late_s = 1.5, 0.1, 0.75  # kept when due: every 5 rounds (a third)
    a = await short_lived(fleet, ttl_s, interval_s)
    b = await short_lived(fleet, ttl_s, interval_s)
    keeper = keeper_of(fleet, a, interval_s=interval_s)
    lease = (await admit(a, fleet.plan("five"), account="t-long", limit=1)).lease
    for _ in range(5):  # kept lately for RECENT rounds; the round after is due
        await bounded(keeper.sweep_once())
        await asyncio.sleep(late_s)  # the next round, late (not a synchronisation)
    await expect_limited(
        admit(b, fleet.plan("five"), account="t-long", limit=1), "concurrency_limit"
    )
    await release_all(a, [lease])
    await fleet.assert_clean()


@pytest.mark.slow
async def test_on_a_cluster_a_node_restarted_empty_has_its_accounts_entries_written_back(
    tmp_path: Path,
) -> None:
    """A master restarted empty that holds an account's key but not the heartbeats': the
    account's entry, no longer recent, must be written back by the next sweep, or another
    request of an account at its limit is admitted."""
    cluster = start_cluster(tmp_path / "c", ["--cluster-require-full-coverage", "no"])
    config = parse_config(CONFIG, "t.yaml")
    inspect = connect(cluster.url, command_timeout_s=2.0)
    fleet = Fleet(config, Registry(config.models), inspect, store="cluster", cluster=cluster)
    try:
        beats = cluster.node_of(REPLICAS_KEY)
        account = next(
            a
            for i in range(100)
            if cluster.node_of(account_key(a := f"t-node-{i}"))
            not in (beats, cluster.node_of("{two}"))
        )
        down = cluster.node_of(account_key(account))
        adm = await fleet.admission()
        keeper = keeper_of(fleet, adm)
        lease = (await admit(adm, fleet.plan("two"), account=account, limit=1)).lease
        for _ in range(RECENT + 1):  # no longer recent
            await bounded(keeper.sweep_once())
        down.restart_empty()
        await asyncio.to_thread(cluster.wait_ok)
        await bounded(keeper.sweep_once())
        with pytest.raises(Limited):
            await admit(adm, fleet.plan("two"), account=account, limit=1)
        await bounded(adm.release(lease))
    finally:
        await fleet.close()
        await inspect.aclose()
        cluster.stop()


async def test_a_failover_that_lost_the_last_round_has_its_new_entries_written_back(
    fleet: Fleet, real_redis: aioredis.Redis
) -> None:
    """A failover to a replica that lagged one round behind: Redis lost an acquire's account
    entry and the round that first kept it, but still knows this replica (its earlier
    heartbeats) and the accounts kept before. An entry is kept at one round only, so the
    next round must see the loss by its heartbeat's mark and write every account back:
    else the account, at its limit, takes a second request on another replica."""
    a, b = await fleet.admission(), await fleet.admission()
    keeper = keeper_of(fleet, a)
    held = (await admit(a, fleet.plan("five"), account="t-old", limit=1)).lease
    for _ in range(RECENT + 1):
        await bounded(keeper.sweep_once())
    lagged = await snapshot(real_redis)  # what the replica that takes over holds
    lease = (await admit(a, fleet.plan("five"), account="t-new", limit=1)).lease
    await bounded(keeper.sweep_once())  # its first keep, and the heartbeat's mark
    await restore(real_redis, lagged)  # the failover
    await bounded(keeper.sweep_once())
    assert await fleet.account("t-new") == 1
    await expect_limited(
        admit(b, fleet.plan("five"), account="t-new", limit=1), "concurrency_limit"
    )
    await release_all(a, [held, lease])
    await fleet.assert_clean()


async def snapshot(client: aioredis.Redis) -> dict[bytes, tuple[bytes, int]]:
    """Every key of the run's Redis, as DUMP gives it, with its time to live (ms)."""
    return {
        key: (cast(bytes, await client.dump(key)), max(0, await client.pttl(key)))
        async for key in client.scan_iter(count=1000)
    }


async def restore(client: aioredis.Redis, keys: dict[bytes, tuple[bytes, int]]) -> None:
    await client.flushdb()
    for key, (dumped, ttl) in keys.items():
        await client.restore(key, ttl, dumped)
