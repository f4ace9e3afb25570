"""Audit of issue 10: promises its own tests left unpinned (each would pass with the fix
removed). Against the real Redis, through the same fleet helpers as test_admission."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.runtime.settings import parse_config
from routing.errors import Unavailable
from routing.registry import Registry
from routing.store.keys import USAGE_STREAM
from tests.factories import usage_record
from tests.routing.admission import test_admission
from tests.routing.admission.test_admission import (
    CONFIG,
    Fleet,
    admit,
    bounded,
    dead_redis,
    expect_limited,
    fill,
    intercept,
    release_all,
)
from tiers.policy import Tier

fleet = test_admission.fleet  # the same fixture: replicas on the real Redis


async def test_retry_after_after_an_idle_spell_is_an_estimate_not_the_cap(fleet: Fleet) -> None:
    """Item 13 through admission: slots freed fast, then idle sweeps decay the measured
    rate towards zero. A fail-fast refusal must still say ~1 s (requests hold a slot for
    milliseconds here), not 60 s: the release must feed the hold-time floor."""
    adm = await fleet.admission()
    keeper = await fleet.keeper(adm, listen=False)
    await bounded(keeper.sweep_once())
    for _ in range(4):
        await release_all(adm, await fill(fleet, adm, "two", 2))
        await bounded(keeper.sweep_once())
    assert adm.retry.freed_rate["two"] > 0
    for _ in range(80):  # an idle spell: nothing freed between sweeps
        await bounded(keeper.sweep_once())
    assert adm.retry.freed_rate["two"] < 1 / 60  # the measured rate alone would say 60 s
    held = await fill(fleet, adm, "two", 2)
    busy = await expect_limited(admit(adm, fleet.plan("two", fail_fast=True)), "model_busy")
    assert busy.retry_after_s <= 2, busy.retry_after_s
    await release_all(adm, held)
    await fleet.assert_clean()


async def test_a_record_holding_a_lone_surrogate_still_releases_and_is_recorded(
    fleet: Fleet,
) -> None:
    """Item 5, second half: whatever the record holds, the release is never skipped. The
    edge refuses such bodies, so only this test reaches the release's own guard."""
    adm = await fleet.admission()
    lease = (await admit(adm, fleet.plan("two"))).lease
    record = usage_record(request_id="t-audit-surrogate", user="a\ud800b").to_fields()
    await bounded(adm.release(lease, record))
    await fleet.assert_clean()
    entries: Any = await fleet.redis.xrange(USAGE_STREAM)
    users = [
        fields[b"user"] for _, fields in entries if fields[b"request_id"] == b"t-audit-surrogate"
    ]
    assert users == [b"a?b"]
    await fleet.redis.delete(USAGE_STREAM)


async def test_a_waiter_whose_admission_reply_was_lost_leaves_the_queue(fleet: Fleet) -> None:
    """Item 10, second half: Redis queued the request but the reply never came back (a
    connection error). The caller is told 503; the entry left in Redis must not stay
    queued, nor take a slot for longer than the claim time."""
    adm = await fleet.admission()
    keeper = await fleet.keeper(adm, listen=False)
    held = await fill(fleet, adm, "two", 2)

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        replies = await send()
        if calls[-1][0] == "acquire":
            raise RedisConnectionError("the reply was lost")
        return replies

    inner = adm.scripts.send
    intercept(adm, around)
    with pytest.raises(Unavailable):
        await admit(adm, fleet.plan("two"))
    adm.scripts.send = inner  # type: ignore[method-assign]
    assert await fleet.queued("two") == 1  # Redis did queue it
    deadline = time.monotonic() + adm.timing.waiter_ttl_ms / 1000 + 3
    while await fleet.queued("two"):
        assert time.monotonic() < deadline, "the lost waiter stays queued"
        await bounded(keeper.sweep_once())
        await asyncio.sleep(0.1)
    await release_all(adm, held)
    await bounded(keeper.sweep_once())
    # Nobody was queued: both slots are free for newcomers at once.
    again = await fill(fleet, adm, "two", 2)
    await release_all(adm, again)
    await bounded(adm.drain())
    await fleet.assert_clean()


async def test_a_reload_gives_the_local_outage_shares_the_new_tiers(fleet: Fleet) -> None:
    """Item 12, second half, through Admission.apply (the reload's entry point), not by
    setting the shares' tiers by hand: flex's ceiling drops from 0.8 to 0.4 of the share."""
    adm = await fleet.admission(on_outage="local", redis=dead_redis(fleet))
    adm.local.saw([adm.replica_id])  # alone in its fleet: its share is the capacity, 5
    lower = "flex: {queue_timeout_s: 0.5, max_utilization: 0.4}"
    config = parse_config(CONFIG.replace("flex: {queue_timeout_s: 0.5}", lower), "t.yaml")
    adm.apply(Registry(config.models), config.tiers)
    held = [(await admit(adm, fleet.plan("five"), Tier.FLEX)).lease for _ in range(2)]
    assert all(lease.local for lease in held)
    await expect_limited(admit(adm, fleet.plan("five"), Tier.FLEX), "flex_no_capacity")
    await release_all(adm, held)
