"""The keeper's rounds (routing/admission/keeper.py) against the run's Redis: the sweep writes back
what Redis lost, says the replica is alive, survives whatever a round raises; the spool
round sends spooled records and reports those Redis refuses. What tests/routing/admission/
test_admission.py already covers (leases kept alive, lost wake-ups, a `_round` that raises
once) is not repeated here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from gateway.runtime.settings import parse_config
from routing.admission.accountkeeps import RECENT
from routing.admission.admit import Admission
from routing.admission.keeper import Keeper
from routing.admission.reserved import RESERVED_EVERY
from routing.admission.tokens import TokenAsk
from routing.background import BackgroundErrors
from routing.ledger.records import UsageSettings
from routing.ledger.spool import UsageSpool
from routing.registry import Registry
from routing.store.causes import StoreErrors
from routing.store.keys import REPLICAS_KEY, USAGE_STREAM, account_key
from tests.conftest import REDIS_URL
from tests.redis_server import StreamEntries
from tests.routing.admission.test_admission import (
    CONFIG,
    Fleet,
    admit,
    bounded,
    intercept,
    release_all,
)
from tiers.policy import Tier

RID = "t-keeper-"


@pytest.fixture
async def fleet(real_redis: aioredis.Redis) -> AsyncIterator[Fleet]:
    config = parse_config(CONFIG, "t.yaml")
    built = Fleet(config, Registry(config.models), real_redis)
    try:
        yield built
    finally:
        await built.close()


class RecordingStoreErrors(StoreErrors):
    """Store errors as reported: (exception, where)."""

    def __init__(self) -> None:
        super().__init__()
        self.reports: list[tuple[BaseException, str]] = []

    def report(self, exc: BaseException, where: str, *, refused: bool = False) -> Any:
        self.reports.append((exc, where))
        return super().report(exc, where, refused=refused)


class SucceedingErrors(BackgroundErrors):
    """Background errors that set `swept` once a sweep round succeeds."""

    def __init__(self) -> None:
        super().__init__()
        self.swept = asyncio.Event()

    def succeeded(self, task: str) -> None:
        super().succeeded(task)
        if task == "sweep":
            self.swept.set()


def is_sweep(calls: Sequence[Any]) -> bool:
    return any(name == "heartbeat" for name, _, _ in calls)


def keeper_of(fleet: Fleet, adm: Admission, **options: Any) -> Keeper:
    """A keeper not started: its rounds are run by hand."""
    return Keeper(adm, fleet.client(socket_timeout=None), **options)


def record(i: int) -> dict[str, str]:
    return {"request_id": f"{RID}{i}", "account": "t-keeper", "status": "200"}


# --- the sweep ---------------------------------------------------------------------------------


async def test_the_sweep_writes_back_what_redis_lost_on_an_empty_restart(
    fleet: Fleet, real_redis: aioredis.Redis
) -> None:
    adm = await fleet.admission()
    keeper = keeper_of(fleet, adm)
    lease = (await admit(adm, fleet.plan("two"))).lease
    await bounded(keeper.sweep_once())
    await real_redis.flushdb()  # Redis restarted with nothing
    assert await fleet.leases("two") == 0 and await fleet.account() == 0
    await bounded(keeper.sweep_once())
    assert await fleet.leases("two") == 1  # the lease, at its endpoint
    assert await fleet.load("two") == 1
    assert await fleet.account() == 1  # and the account's entry
    assert keeper.states["two"].inflight == 1
    await bounded(adm.release(lease))
    await fleet.assert_clean()


async def test_an_account_is_kept_at_every_round_only_while_its_entries_are_recent(
    fleet: Fleet,
) -> None:
    """With 10,000 accounts waiting a keep per account and round was most of Redis's work:
    an account whose entries every round kept for RECENT rounds is kept again when due."""
    adm = await fleet.admission()
    keeper = keeper_of(fleet, adm)
    kept: list[int] = []

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        if is_sweep(calls):
            kept.append(sum(1 for name, _, _ in calls if name == "account_keep"))
        return await send()

    intercept(adm, around)
    lease = (await admit(adm, fleet.plan("two"))).lease
    for _ in range(RECENT + 3):
        await bounded(keeper.sweep_once())
    assert kept == [1] * RECENT + [0] * 3, kept
    await bounded(adm.release(lease))
    await fleet.assert_clean()


async def test_on_one_redis_the_accounts_are_kept_in_one_call(
    fleet: Fleet, real_redis: aioredis.Redis
) -> None:
    adm = await fleet.admission()
    keeper = keeper_of(fleet, adm)
    calls: list[tuple[str, Sequence[str]]] = []

    async def around(sent: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        calls.extend((name, keys) for name, keys, _ in sent if name == "account_keep")
        return await send()

    intercept(adm, around)
    accounts = [f"t-keep-{i}" for i in range(2)]  # ("two" holds 2)
    leases = [(await admit(adm, fleet.plan("two"), account=a)).lease for a in accounts]
    for a in accounts:
        await real_redis.delete(account_key(a))  # lost: each written back
    await bounded(keeper.sweep_once())
    assert len(calls) == 1 and sorted(calls[0][1]) == sorted(account_key(a) for a in accounts)
    assert all([await fleet.account(a) for a in accounts])
    for lease in leases:
        await bounded(adm.release(lease))
    await fleet.assert_clean()


async def test_an_empty_restart_has_every_account_written_back_by_the_sweep_that_finds_it(
    fleet: Fleet, real_redis: aioredis.Redis
) -> None:
    adm = await fleet.admission()
    keeper = keeper_of(fleet, adm)
    lease = (await admit(adm, fleet.plan("two"))).lease
    for _ in range(RECENT + 1):  # its entry no longer recent: not kept at every round
        await bounded(keeper.sweep_once())
    await real_redis.flushdb()  # Redis restarted with nothing
    await bounded(keeper.sweep_once())
    assert await fleet.leases("two") == 1
    assert await fleet.account() == 1  # the account's entry, by the same sweep
    await bounded(adm.release(lease))
    await fleet.assert_clean()


async def test_an_empty_restart_found_by_a_round_whose_reply_was_lost_has_every_account_back(
    fleet: Fleet, real_redis: aioredis.Redis
) -> None:
    """The first round after an empty restart runs in Redis, but its reply never comes (the
    connection dropped, the deadline passed): its heartbeat wrote this replica back, so the
    next one finds it there. The accounts' entries no longer recent must still be written
    back by that next round (within one sweep, as every loss), not when due (a third of the
    TTL)."""
    adm = await fleet.admission()
    keeper = keeper_of(fleet, adm)
    lease = (await admit(adm, fleet.plan("two"))).lease
    for _ in range(RECENT + 1):  # its entry no longer recent: not kept at every round
        await bounded(keeper.sweep_once())
    await real_redis.flushdb()  # Redis restarted with nothing
    lost = True

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        nonlocal lost
        replies = await send()
        if lost and is_sweep(calls):
            lost = False
            raise RedisConnectionError("connection lost")  # after Redis ran the round
        return replies

    intercept(adm, around)
    with pytest.raises(RedisConnectionError):
        await bounded(keeper.sweep_once())
    await bounded(keeper.sweep_once())
    assert await fleet.leases("two") == 1
    assert await fleet.account() == 1  # the account's entry, by the round after
    await bounded(adm.release(lease))
    await fleet.assert_clean()


async def test_the_sweep_says_the_replica_is_alive(
    fleet: Fleet, real_redis: aioredis.Redis
) -> None:
    adm = await fleet.admission()
    await bounded(keeper_of(fleet, adm).sweep_once())
    assert await real_redis.zscore(REPLICAS_KEY, adm.replica_id) is not None


async def test_a_sweep_that_never_ran_knows_no_model(fleet: Fleet) -> None:
    adm = await fleet.admission()
    keeper = keeper_of(fleet, adm)
    assert keeper.states == {}
    await bounded(keeper.sweep_once())
    assert set(keeper.states) == set(fleet.registry.names())
    assert all(state.inflight == 0 for state in keeper.states.values())


async def test_the_sweep_loop_goes_on_through_unexpected_errors_and_counts_them(
    fleet: Fleet,
) -> None:
    """Rounds whose store call raises something no one foresaw (not a Redis error) are
    counted one by one; the loop runs the next round, which applies as usual."""
    adm = await fleet.admission()
    errors = SucceedingErrors()
    keeper = keeper_of(fleet, adm, interval_s=0.0, errors=errors)
    failures = 3

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        nonlocal failures
        if is_sweep(calls) and failures:
            failures -= 1
            raise KeyError("a bug in a round")
        return await send()

    intercept(adm, around)
    await keeper.start()
    try:
        await bounded(errors.swept.wait())
    finally:
        await bounded(keeper.close())
    assert errors.counts["sweep"] == 3
    assert keeper.states["two"].inflight == 0


async def test_a_sweep_with_an_error_reply_applies_the_rest_and_raises(fleet: Fleet) -> None:
    """One model's call refused by Redis: the others' replies still apply, and the round
    raises (for `every` to count)."""
    adm = await fleet.admission()
    keeper = keeper_of(fleet, adm)
    names = list(adm.slots)
    refused = names[0]

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        replies = await send()
        if is_sweep(calls):
            # The first model's sweep (behind the index calls of a first round).
            at = next(i for i, (name, _, _) in enumerate(calls) if name == "sweep")
            replies[at] = ResponseError("BUSY refused")
        return replies

    intercept(adm, around)
    with pytest.raises(ResponseError):
        await bounded(keeper.sweep_once())
    assert refused not in keeper.states
    assert set(keeper.states) == set(names[1:])


async def test_a_round_that_fails_whole_has_its_index_writes_written_again(
    fleet: Fleet,
) -> None:
    """The round's index change may or may not have landed: a penalty change keeps the
    version, so no sweep would notice; the next write is whole."""
    adm = await fleet.admission()
    keeper = keeper_of(fleet, adm)
    await bounded(keeper.sweep_once())  # the index written
    adm.slots["two"].set_endpoints([("http://two-a:8000", 1, 0.5), ("http://two-b:8000", 1, 0.0)])

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        raise ConnectionError("the round's connection broke")

    intercept(adm, around)
    with pytest.raises(ConnectionError):
        await bounded(keeper.sweep_once())
    call = adm.slots["two"].index()
    assert call is not None and call[2][1] == ""  # whole: no base version


async def test_the_local_shares_add_up_when_a_sweep_runs_behind_an_unanswered_acquire(
    fleet: Fleet,
) -> None:
    """A sweep reads the model's in-flight count; the replica's own leases among it must be
    read in the same instant. An acquire Redis ran before the sweep but whose reply the
    replica has not taken in yet (its lease not held yet when the round was built) is in
    the count, so it is the replica's too: else the local shares of an outage right after
    (on_outage: local) add up to less than the capacity (tests/e2e/test_faults.py)."""
    a = await fleet.admission(on_outage="local")
    b = await fleet.admission(on_outage="local")
    sweep_a, sweep_b = keeper_of(fleet, a), keeper_of(fleet, b)
    leases = [(await admit(a, fleet.plan("five"))).lease]
    await bounded(sweep_a.sweep_once())
    await bounded(sweep_b.sweep_once())  # both alive: each sees the other from now on
    swept = False

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        nonlocal swept
        replies = await send()
        if not swept and any(name == "acquire" for name, _, _ in calls):
            swept = True  # Redis ran the acquire; its reply waits behind a whole sweep
            await bounded(sweep_a.sweep_once())
        return replies

    intercept(a, around)
    leases.append((await admit(a, fleet.plan("five"))).lease)
    await bounded(sweep_b.sweep_once())
    assert swept and a.local.replicas == b.local.replicas == 2
    assert sweep_a.states["five"].inflight == sweep_b.states["five"].inflight == 2
    limits = [a.local.limit("five"), b.local.limit("five")]  # capacity 5: 2 held + 3 free
    assert sum(limits) == 5 and limits[0] >= 2, limits
    await release_all(a, leases)
    await fleet.assert_clean()


# --- the spool round ---------------------------------------------------------------------------


async def test_the_spool_round_without_a_spool_does_nothing(fleet: Fleet) -> None:
    adm = await fleet.admission()
    sent: list[Sequence[Any]] = []

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        sent.append(calls)
        return await send()

    intercept(adm, around)
    await bounded(keeper_of(fleet, adm)._tend_spool())
    assert sent == []


async def test_the_spool_round_sends_the_spooled_records(
    fleet: Fleet, usage_redis: aioredis.Redis, tmp_path: Path
) -> None:
    spool = UsageSpool(UsageSettings(spool_dir=str(tmp_path)), REDIS_URL)
    adm = await fleet.admission(spool=spool)
    for i in range(3):
        assert spool.add(record(i))
    await bounded(keeper_of(fleet, adm)._tend_spool())
    assert not spool.pending()
    entries = cast(StreamEntries, await usage_redis.xrange(USAGE_STREAM))
    rids = [fields[b"request_id"].decode() for _, fields in entries]
    assert [rid for rid in rids if rid.startswith(RID)] == [f"{RID}{i}" for i in range(3)]


async def test_a_record_redis_refuses_is_reported_and_stays_spooled(
    fleet: Fleet, usage_redis: aioredis.Redis, tmp_path: Path
) -> None:
    spool = UsageSpool(UsageSettings(spool_dir=str(tmp_path)), REDIS_URL)
    adm = await fleet.admission(spool=spool)
    store = RecordingStoreErrors()
    keeper = keeper_of(fleet, adm, errors=BackgroundErrors(store))
    assert spool.add(record(1))

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        if calls[0][0] == "usage":
            return [ResponseError("OOM command not allowed") for _ in calls]
        return await send()

    intercept(adm, around)
    await bounded(keeper._tend_spool())
    assert [where for _, where in store.reports] == ["spool"]
    assert isinstance(store.reports[0][0], ResponseError)
    assert spool.pending()  # tried again next round


# --- the tokens reserved, for the metrics ------------------------------------------------------

BUDGETED = """
models:
  tb:
    max_tokens_default: 10
    endpoints:
      - {url: "http://tb-a:8000", max_concurrency: 2, max_tokens_in_flight: 1000}
      - {url: "http://tb-b:8000", max_concurrency: 2, max_tokens_in_flight: 1000}
"""


async def test_the_tokens_reserved_on_an_endpoint_out_of_rotation_are_still_read(
    real_redis: aioredis.Redis,
) -> None:
    """An endpoint that left rotation with reservations on it: once they end, the metric
    says 0 there, not what it held when it left (nor after every endpoint left)."""
    config = parse_config(BUDGETED, "t.yaml")
    fleet = Fleet(config, Registry(config.models), real_redis)
    try:
        adm = await fleet.admission()
        keeper = keeper_of(fleet, adm)
        admitted = await bounded(adm.admit(fleet.plan("tb"), "t-acme", 10, tokens=TokenAsk(90)))
        url = admitted.lease.endpoint
        await bounded(keeper.sweep_once())
        assert keeper.reserved["tb", url] == 100
        adm.set_endpoints("tb", [])  # both out of rotation (unhealthy)
        await bounded(adm.release(admitted.lease))
        await bounded(adm.drain())
        for _ in range(RESERVED_EVERY):
            await bounded(keeper.sweep_once())
        assert keeper.reserved["tb", url] == 0
    finally:
        await fleet.close()


async def sweeps_reading_reserved(keeper: Keeper) -> None:
    """Enough sweeps that one of them reads the reserved tokens."""
    for _ in range(RESERVED_EVERY):
        await bounded(keeper.sweep_once())


async def test_an_endpoint_a_reload_removed_leaves_the_reserved_tokens_once_they_end(
    real_redis: aioredis.Redis,
) -> None:
    """An endpoint a reload takes away is read while its reservations end, then dropped
    (its series goes too: tests/gateway/runtime/test_budgets.py); one still configured stays at 0,
    out of rotation or not. So is a whole model a reload took away."""
    both = BUDGETED + (
        "  tc:\n    max_tokens_default: 10\n    endpoints:\n"
        '      - {url: "http://tc-a:8000", max_concurrency: 2, max_tokens_in_flight: 1000}\n'
    )
    config = parse_config(both, "t.yaml")
    fleet = Fleet(config, Registry(config.models), real_redis)
    try:
        adm = await fleet.admission()
        keeper = keeper_of(fleet, adm)
        admitted = await bounded(adm.admit(fleet.plan("tb"), "t-acme", 10, tokens=TokenAsk(90)))
        url = admitted.lease.endpoint
        other = next(u for u in ("http://tb-a:8000", "http://tb-b:8000") if u != url)
        await sweeps_reading_reserved(keeper)
        assert keeper.reserved == {
            ("tb", url): 100,
            ("tb", other): 0,
            ("tc", "http://tc-a:8000"): 0,
        }
        # A reload: `url` leaves tb's endpoints (its lease runs on), tc leaves the config.
        # As the gateway applies it: the config, then the endpoints in rotation.
        endpoint = f'{{url: "{other}", max_concurrency: 2, max_tokens_in_flight: 1000}}'
        kept = f"models: {{tb: {{max_tokens_default: 10, endpoints: [{endpoint}]}}}}"
        reloaded = parse_config(kept, "t.yaml")
        adm.apply(Registry(reloaded.models), reloaded.tiers)
        adm.set_endpoints("tb", [(other, 2, 0.0, 1000)])
        adm.set_endpoints("tc", [])
        await sweeps_reading_reserved(keeper)
        assert keeper.reserved == {("tb", url): 100, ("tb", other): 0}  # still held there
        await bounded(adm.release(admitted.lease))
        await bounded(adm.drain())
        await sweeps_reading_reserved(keeper)
        assert keeper.reserved == {("tb", other): 0}
        await sweeps_reading_reserved(keeper)
        assert keeper.reserved == {("tb", other): 0}  # and nothing comes back
    finally:
        await fleet.close()


async def test_a_sweep_tells_redis_a_flex_request_began_where_its_check_went_unanswered(
    fleet: Fleet,
) -> None:
    """The check before a flex request's first byte got no answer: it began all the same
    (routing/admission/preemption.py). Redis still offers its lease to preemption until
    the next sweep that reaches it tells it the request started."""
    adm = await fleet.admission()
    keeper = keeper_of(fleet, adm)
    admitted = await admit(adm, fleet.plan("two"), Tier.FLEX)
    assert admitted.preemptible
    lease = admitted.lease
    down = {"start": True}

    async def around(calls: Sequence[Any], send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        if down["start"] and calls[0][0] == "start":
            raise RedisConnectionError("connection lost")
        return await send()

    intercept(adm, around)
    adm.preemptions.watch(lease.id)
    assert await bounded(adm.preemptions.started(lease))
    pre, member = adm.slots[lease.keys].pre_key, f"{lease.id} {lease.endpoint}"
    assert await fleet.redis.zscore(pre, member) is not None  # still offered
    down["start"] = False
    await bounded(keeper.sweep_once())
    assert await fleet.redis.zscore(pre, member) is None
    await bounded(adm.release(lease))
    await bounded(adm.drain())
    await fleet.assert_clean()
