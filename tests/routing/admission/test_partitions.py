"""A model split over partitions (`models.<m>.partitions`, routing/admission/partitions.py):
names whose hash slots spread over a Cluster's masters, every endpoint in exactly one, and
admission across them against the real Redis (and a 3-master Cluster): spill before queueing,
fail_fast, tier ceilings and the account limit exact over all of them."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.crc import key_slot

from gateway.runtime.settings import parse_config
from routing.admission.admit import Admission, Admitted, Lease
from routing.admission.partitions import Rotation, partition_names, partition_of, split
from routing.admission.slots import ModelSlots
from routing.admission.timing import Timing
from routing.registry import EndpointConfig, ModelConfig, Registry
from routing.store.connect import RedisPyStore, connect
from tests.redis_cluster import RedisCluster
from tests.routing.admission.test_admission import (
    Fleet,
    admit,
    bounded,
    expect_limited,
    release_all,
    running,
    watch_queued,
)
from tiers.policy import Tier


def dealt_evenly(k: int, per: int) -> list[str]:
    """Endpoint URLs whose partitions (a hash of the URL) come out `per` to each of `k`,
    listed so that the i-th is in partition i % k."""
    found: list[list[str]] = [[] for _ in range(k)]
    for i in range(10_000):
        url = f"http://wide-{i}:8000"
        mine = found[partition_of(url, k)]
        if len(mine) < per:
            mine.append(url)
        if all(len(f) == per for f in found):
            return [found[p][j] for j in range(per) for p in range(k)]
    raise AssertionError("no even split found")


WIDE = dealt_evenly(4, 2)
CONFIG = f"""
tiers:
  priority: {{queue_timeout_s: 5}}
  default: {{queue_timeout_s: 5}}
  flex: {{queue_timeout_s: 0.5, max_utilization: 0.5}}
models:
  wide:
    tiers: [default, priority, flex]
    partitions: 4
    max_queue: 8
    endpoints:
{"".join(f'      - {{url: "{u}", max_concurrency: 1}}{chr(10)}' for u in WIDE)}"""
PARTS = partition_names("wide", 4)
# How `redis-cli --cluster create` splits the slots over 3 masters.
THIRDS = (5461, 10923)


def master_of(slot: int) -> int:
    return sum(slot >= bound for bound in THIRDS)


# --- names, split, order ---------------------------------------------------------------------


@pytest.mark.parametrize("model", ["wide", "meta-llama/Llama-3.1-8B", "m", "x" * 200])
def test_partitions_land_on_every_master_of_a_three_master_cluster(model: str) -> None:
    names = partition_names(model, 4)
    assert names[0] == model and len(set(names)) == 4
    slots = [key_slot(n.encode()) for n in names]
    assert {master_of(s) for s in slots} == {0, 1, 2}
    two = [key_slot(n.encode()) for n in partition_names(model, 2)]
    assert master_of(two[0]) != master_of(two[1])
    assert partition_names(model, 1) == (model,)


def test_every_endpoint_is_in_exactly_one_partition_and_stays_there() -> None:
    urls = [f"http://10.0.0.{i}:8000" for i in range(200)]
    dealt = split(urls, 4, str)
    assert sorted(u for p in dealt for u in p) == sorted(urls)
    assert all(30 <= len(p) <= 70 for p in dealt), [len(p) for p in dealt]
    # Endpoints that come or go move no other one.
    fewer = split([*urls[50:], "http://10.0.1.1:8000"], 4, str)
    for before, after in zip(dealt, fewer, strict=True):
        assert set(before) - set(urls[:50]) <= set(after)
    assert split(urls, 1, str) == [urls]


def test_more_partitions_than_endpoints_is_refused_naming_the_key() -> None:
    with pytest.raises(ValidationError, match="partitions"):
        ModelConfig.model_validate(
            {"partitions": 3, "endpoints": [{"url": WIDE[0], "max_concurrency": 1}] * 1}
        )


def test_the_order_rotates_keeps_a_cache_key_and_queues_at_the_shortest_queue() -> None:
    rotation = Rotation(PARTS)
    timing = Timing(1000, 1000, 1000)
    slots = {p: ModelSlots(p, dict.fromkeys(Tier, 1.0), 10, timing) for p in PARTS}
    for p in PARTS:
        slots[p].set_endpoints([(f"http://{p}:8000", 1, 0.0)])
    firsts = [rotation.order(None, False, Tier.DEFAULT, slots)[0][0] for _ in range(8)]
    assert Counter(firsts) == {p: 2 for p in PARTS}
    keyed = {rotation.order("conversation-7", False, Tier.DEFAULT, slots)[0][0] for _ in range(5)}
    assert len(keyed) == 1
    for p in PARTS:
        slots[p].seen_queue = {Tier.PRIORITY: 0, Tier.DEFAULT: 3, Tier.FLEX: 0}
    slots[PARTS[2]].seen_queue = {Tier.PRIORITY: 0, Tier.DEFAULT: 1, Tier.FLEX: 9}
    order = rotation.order(None, True, Tier.DEFAULT, slots)
    assert sorted(p for p, _ in order) == sorted(PARTS)
    assert order[-1] == (PARTS[2], True)
    assert not any(may for _, may in order[:-1])
    # A priority request counts only priority waiters: every queue is as short.
    assert rotation.order(None, True, Tier.PRIORITY, slots)[-1][1]


# --- admission over partitions ---------------------------------------------------------------


@pytest.fixture(params=["resp", pytest.param("cluster", marks=pytest.mark.slow)])
async def wide(real_redis: aioredis.Redis, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    config = parse_config(CONFIG, "t.yaml")
    if request.param == "cluster":
        cluster: RedisCluster = request.getfixturevalue("empty_cluster")
        inspect = connect(cluster.url, command_timeout_s=2.0)
        built = Fleet(config, Registry(config.models), inspect, store="cluster", cluster=cluster)
    else:
        built = Fleet(config, Registry(config.models), real_redis, store="resp")
    async with running(built):
        yield built


async def in_parts(fleet: Fleet, key: str) -> dict[str, int]:
    return {p: int(await fleet.redis.zcard("gw:v2:{" + p + "}:" + key)) for p in PARTS}


async def test_requests_spill_over_every_partition_before_any_queues(wide: Fleet) -> None:
    adm = await wide.admission()
    queued = watch_queued(adm)
    held = [(await admit(adm, wide.plan("wide"))).lease for _ in range(8)]
    assert sorted(lease.endpoint for lease in held) == sorted(WIDE)
    assert await in_parts(wide, "leases") == {p: 2 for p in PARTS}
    assert {lease.keys for lease in held} == set(PARTS)
    assert adm.capacity("wide") == 8
    # Full everywhere: fail_fast answers at once, having queued nowhere.
    await expect_limited(admit(adm, wide.plan("wide", fail_fast=True)), "model_busy")
    assert queued.empty()
    assert await in_parts(wide, "queue") == {p: 0 for p in PARTS}
    assert await wide.account() == 8
    await release_all(adm, held)
    await wide.assert_clean()


async def full_with_a_waiter(
    wide: Fleet, adm: Admission, slots: int
) -> tuple[asyncio.Task[Admitted], list[Lease]]:
    """`slots` leases held (every slot in rotation), then a request that queues."""
    await wide.keeper(adm)
    queued = watch_queued(adm)
    held = [(await admit(adm, wide.plan("wide"))).lease for _ in range(slots)]
    waiter = asyncio.create_task(admit(adm, wide.plan("wide")))
    await bounded(queued.get())
    return waiter, held


async def serve_and_clean(
    wide: Fleet, adm: Admission, waiter: asyncio.Task[Admitted], held: list[Lease]
) -> None:
    """Free a slot in the waiter's own partition: that release serves it; then all go."""
    depth = await in_parts(wide, "queue")
    assert sorted(depth.values())[-2:] == [0, 1]
    part = next(p for p, n in depth.items() if n)
    freed = next(lease for lease in held if lease.keys == part)
    await bounded(adm.release(freed))
    served = (await bounded(waiter)).lease
    assert (served.keys, served.endpoint) == (part, freed.endpoint)
    await release_all(adm, [lease for lease in held if lease is not freed] + [served])
    await wide.assert_clean()


async def test_a_waiter_queues_in_one_partition_and_its_release_serves_it(wide: Fleet) -> None:
    adm = await wide.admission()
    waiter, held = await full_with_a_waiter(wide, adm, 8)
    assert sorted((await in_parts(wide, "queue")).values()) == [0, 0, 0, 1]
    await serve_and_clean(wide, adm, waiter, held)


async def test_tier_ceilings_and_the_account_limit_hold_over_all_partitions(wide: Fleet) -> None:
    adm = await wide.admission()
    flex = wide.plan("wide", fail_fast=True)
    # Flex may hold half of each partition: 4 of the 8 slots, however they are spread.
    held = [(await admit(adm, flex, Tier.FLEX)).lease for _ in range(4)]
    assert await in_parts(wide, "leases") == {p: 1 for p in PARTS}
    await expect_limited(admit(adm, flex, Tier.FLEX), "flex_no_capacity")
    # The account's limit counts every partition's leases: 6 in flight at most.
    held += [(await admit(adm, flex, limit=6)).lease for _ in range(2)]
    await expect_limited(admit(adm, flex, limit=6), "concurrency_limit")
    assert await wide.account() == 6
    assert sum((await in_parts(wide, "leases")).values()) == 6
    # Another account takes the last two, by priority, then the model is full.
    held += [(await admit(adm, flex, Tier.PRIORITY, account="t-b")).lease for _ in range(2)]
    await expect_limited(admit(adm, flex, Tier.PRIORITY, account="t-b"), "model_busy")
    await release_all(adm, held)
    await wide.assert_clean()


async def test_on_a_cluster_each_master_serves_a_share_of_one_model(
    empty_cluster: RedisCluster, real_redis: aioredis.Redis
) -> None:
    config = parse_config(CONFIG, "t.yaml")
    inspect = connect(empty_cluster.url, command_timeout_s=2.0)
    fleet = Fleet(config, Registry(config.models), inspect, store="cluster", cluster=empty_cluster)
    try:
        adm = await fleet.admission()
        held = [(await admit(adm, fleet.plan("wide"))).lease for _ in range(8)]
        masters = Counter(empty_cluster.node_of("{" + lease.keys + "}").port for lease in held)
        assert len(masters) == 3 and sum(masters.values()) == 8, masters
        await release_all(adm, held)
        await fleet.assert_clean()
    finally:
        await fleet.close()
        await inspect.aclose()


async def test_an_endpoint_out_of_rotation_leaves_its_own_partition_only(wide: Fleet) -> None:
    adm = await wide.admission()
    down = WIDE[1]  # the second endpoint: the second partition's first
    adm.set_endpoints("wide", [(u, 1, 0.0) for u in WIDE if u != down])
    assert [adm.slots[p].capacity for p in PARTS] == [2, 1, 2, 2]
    held = [(await admit(adm, wide.plan("wide"))).lease for _ in range(7)]
    assert sorted(lease.endpoint for lease in held) == sorted(set(WIDE) - {down})
    await expect_limited(admit(adm, wide.plan("wide", fail_fast=True)), "model_busy")
    await release_all(adm, held)
    await wide.assert_clean()


async def test_a_reload_to_fewer_partitions_drains_the_old_ones(wide: Fleet) -> None:
    adm = await wide.admission()
    before = [(await admit(adm, wide.plan("wide"))).lease for _ in range(4)]
    config = parse_config(CONFIG.replace("partitions: 4", "partitions: 2"), "t.yaml")
    adm.apply(Registry(config.models), config.tiers)
    adm.set_endpoints("wide", [(u, 1, 0.0) for u in WIDE])  # health's view, as after a reload
    now = partition_names("wide", 2)
    assert now[0] == "wide" and adm.capacity("wide") == 8
    sizes = Counter(partition_of(u, 2) for u in WIDE)
    assert [adm.slots[p].capacity for p in now] == [sizes[0], sizes[1]]
    assert all(adm.slots[p].capacity == 0 for p in set(PARTS) - set(now))
    after = [(await admit(adm, wide.plan("wide"))).lease for _ in range(4)]
    assert {lease.keys for lease in after} <= set(now)
    await release_all(adm, before + after)
    for part in {*PARTS, *now}:
        assert await wide.redis.zcard("gw:v2:{" + part + "}:leases") == 0, part
    await wide.assert_clean()


async def test_a_partition_with_no_endpoint_in_rotation_is_never_where_one_waits(
    wide: Fleet,
) -> None:
    adm = await wide.admission()
    dead = {u for u in WIDE if partition_of(u, 4) == 1}
    adm.set_endpoints("wide", [(u, 1, 0.0) for u in WIDE if u not in dead])
    # Its queue looks the shortest (empty), but nobody could be served there.
    order = adm.rotations["wide"].order(None, True, Tier.DEFAULT, adm.slots)
    assert PARTS[1] not in {p for p, _ in order} and order[-1][1]
    waiter, held = await full_with_a_waiter(wide, adm, 6)
    assert all(lease.keys != PARTS[1] for lease in held)
    assert (await in_parts(wide, "queue"))[PARTS[1]] == 0
    await serve_and_clean(wide, adm, waiter, held)


def test_a_partition_the_hash_leaves_empty_is_said_and_the_others_share_the_queue(
    caplog: pytest.LogCaptureFixture,
) -> None:
    same = [u for u in (f"http://gpu-{i}:8000" for i in range(100)) if partition_of(u, 2) == 1]
    text = CONFIG.replace("partitions: 4", "partitions: 2").replace("max_queue: 8", "max_queue: 9")
    config = parse_config(text, "t.yaml")
    endpoints = tuple(EndpointConfig(url=u, max_concurrency=1) for u in same[:3])
    wide = config.models["wide"].model_copy(update={"endpoints": endpoints})
    registry = Registry({"wide": wide})
    with caplog.at_level(logging.WARNING, logger="gateway.admission"):
        store = RedisPyStore(fakeredis.FakeAsyncRedis(), 2.0)
        adm = Admission(store, registry, config.tiers, lease_ttl_s=30, on_outage="reject")
    parts = partition_names("wide", 2)
    assert [adm.slots[p].capacity for p in parts] == [0, 3]
    assert adm.slots[parts[1]].max_queue == 9
    assert "1 of its 2 partitions got no endpoint" in caplog.text


async def test_a_waiter_whose_partition_leaves_rotation_during_its_walk_queues_in_another(
    wide: Fleet,
) -> None:
    """Every slot held; a request that may wait tries the partitions in turn, and the one it
    was to queue in goes out of rotation while it tries the others (health, a reload): it
    queues in one still in rotation, never answered `model_busy` as a fail_fast one."""
    adm = await wide.admission()
    await wide.keeper(adm)
    held = [(await admit(adm, wide.plan("wide"))).lease for _ in range(8)]
    order = adm.rotations["wide"].order(None, True, Tier.DEFAULT, adm.slots)
    adm.rotations["wide"]._next -= 1  # the walk below gets that order
    gone = order[-1][0]
    tries = adm.acquire.try_one

    async def first_try_takes_it_out(*args: Any, **kwargs: Any) -> Any:
        adm.acquire.try_one = tries  # type: ignore[method-assign]
        left = [(u, 1, 0.0) for u in WIDE if partition_of(u, 4) != PARTS.index(gone)]
        adm.set_endpoints("wide", left)
        return await tries(*args, **kwargs)

    adm.acquire.try_one = first_try_takes_it_out  # type: ignore[method-assign]
    queued = watch_queued(adm)
    late = asyncio.create_task(admit(adm, wide.plan("wide")))
    await bounded(queued.get())
    depth = await in_parts(wide, "queue")
    assert depth[gone] == 0 and sum(depth.values()) == 1
    part = next(p for p, n in depth.items() if n)
    freed = next(lease for lease in held if lease.keys == part)
    await bounded(adm.release(freed))
    held.remove(freed)
    held.append((await bounded(late)).lease)
    await release_all(adm, held)
    await wide.assert_clean()
