"""A Redis Cluster under faults: resharded under traffic (the slot of a model and the slot
of the usage stream move to other masters while two replicas admit and release: no slot
leaked, no usage record missing or doubled, no model over its capacity, no request refused
for want of Redis), a master down then back empty (its models only are an outage), and an
ACL user with only the documented permissions."""

from __future__ import annotations

import asyncio
import random
import re
from collections import Counter
from pathlib import Path
from typing import cast

import pytest

from gateway.runtime.settings import parse_config
from routing.errors import Limited, Unavailable
from routing.ledger.records import UsageSettings
from routing.ledger.spool import UsageSpool
from routing.registry import Registry
from routing.store.cluster import ClusterStore
from routing.store.connect import connect
from routing.store.probe import probe
from tests.factories import usage_record
from tests.redis_cluster import RedisCluster, start_cluster
from tests.redis_server import RedisServer, StreamEntries
from tests.routing.admission.test_admission import CONFIG, Fleet, admit, bounded, riding
from tiers.policy import Tier

# Redis Clusters resharded, a master down: not in `make check`.
pytestmark = pytest.mark.slow

REQUESTS = 160


async def test_slots_moved_during_traffic_lose_nothing(
    empty_cluster: RedisCluster, tmp_path: Path
) -> None:
    cluster = empty_cluster
    config = parse_config(CONFIG, "t.yaml")
    inspect = connect(cluster.url, command_timeout_s=2.0)
    fleet = Fleet(config, Registry(config.models), inspect, store="cluster", cluster=cluster)
    moves = [(cluster.slot("{two}"), cluster.node_of("{two}")),
             (cluster.slot("{usage}"), cluster.node_of("{usage}"))]  # fmt: skip
    try:
        spools = [
            UsageSpool(UsageSettings(spool_dir=str(tmp_path / f"r{i}")), cluster.url)
            for i in (0, 1)
        ]
        replicas = [await fleet.admission(spool=spool) for spool in spools]
        for adm in replicas:
            await fleet.keeper(adm, interval_s=0.1)
        recorded, outcomes = await _traffic_while_moving(fleet, cluster, moves)
        for adm in replicas:
            await bounded(adm.ledger.flush())  # what Redis could not take meanwhile
        redirects = sum((cast(ClusterStore, a.store).redirects for a in replicas), Counter())
        await fleet.close()
        assert redirects["MOVED"] > 0, redirects  # the replicas did meet the moves
        assert outcomes["admitted"] > 0 and outcomes["unavailable"] == 0, outcomes
        entries = cast(StreamEntries, await inspect.xrange("usage"))
        ids = Counter(f[b"request_id"].decode() for _, f in entries)
        assert ids == Counter(recorded), "a usage record lost or doubled"
        await fleet.assert_clean()
        for slot, source in moves:
            assert cluster.node_of_slot(slot) is not source  # the moves did happen
    finally:
        await fleet.close()
        for slot, source in moves:
            if cluster.node_of_slot(slot) is not source:
                cluster.move_slot(slot, source)
        await inspect.aclose()


async def _traffic_while_moving(
    fleet: Fleet, cluster: RedisCluster, moves: list[tuple[int, RedisServer]]
) -> tuple[list[str], Counter[str]]:
    rng = random.Random(7)
    capacity = {m.name: m.capacity for m in fleet.registry}
    inflight: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    recorded: list[str] = []
    started = asyncio.Event()
    adms = list(fleet._admissions)

    async def request(i: int) -> None:
        adm = adms[i % 2]
        names = ("two", "five") if rng.random() < 0.5 else ("two",)
        await asyncio.sleep(rng.uniform(0, 0.4))
        try:
            admitted = await adm.admit(riding(fleet.plan(*names), Tier.DEFAULT), "t-acme", 100)
        except Limited:
            outcomes["limited"] += 1
            return
        except Exception:
            outcomes["unavailable"] += 1
            return
        started.set()
        model = admitted.lease.model
        inflight[model] += 1
        assert inflight[model] <= capacity[model], model
        await asyncio.sleep(rng.uniform(0, 0.02))
        inflight[model] -= 1
        rid = f"t-reshard-{i}"
        recorded.append(rid)
        await adm.release(admitted.lease, usage_record(request_id=rid).to_fields())
        outcomes["admitted"] += 1

    async def move() -> None:
        await bounded(started.wait())
        others = [n for n in cluster.nodes]
        for slot, source in moves:
            target = next(n for n in others if n is not source)
            await asyncio.to_thread(cluster.move_slot, slot, target)

    tasks = [asyncio.create_task(request(i)) for i in range(REQUESTS)]
    await bounded(asyncio.gather(move(), *tasks), 30)
    return recorded, outcomes


async def test_a_master_down_is_an_outage_of_its_models_only(tmp_path: Path) -> None:
    # Partial coverage, as a Cluster that should serve what it can is run: the live masters
    # keep serving however long the dead one stays away (no timing in this test).
    cluster = start_cluster(tmp_path / "c", ["--cluster-require-full-coverage", "no"])
    config = parse_config(CONFIG, "t.yaml")
    inspect = connect(cluster.url, command_timeout_s=2.0)
    fleet = Fleet(config, Registry(config.models), inspect, store="cluster", cluster=cluster)
    try:
        down = cluster.node_of("{five}")
        assert cluster.node_of("{two}") is not down and cluster.node_of("{t-acme}") is not down
        adm = await fleet.admission()
        down.kill()
        lease = (await admit(adm, fleet.plan("two"))).lease  # another master: served
        with pytest.raises(Unavailable):
            await admit(adm, fleet.plan("five"))
        await bounded(adm.release(lease))
        down.restart_empty()  # back, knowing its slots, without data or scripts
        await asyncio.to_thread(cluster.wait_ok)
        lease = (await admit(adm, fleet.plan("five"))).lease
        await bounded(adm.release(lease))
        await fleet.close()
        await fleet.assert_clean()
    finally:
        await fleet.close()
        await inspect.aclose()
        cluster.stop()


# What a Cluster asks of an ACL user besides docs/redis.md's rule (docs/config.md says so).
CLUSTER_ACL = "+info +cluster|info +cluster|slots +command"
REDIS_DOC = (Path(__file__).resolve().parents[3] / "docs" / "redis.md").read_text("utf-8")


async def test_the_documented_acl_is_all_a_cluster_needs(
    empty_cluster: RedisCluster, tmp_path: Path
) -> None:
    assert CLUSTER_ACL in REDIS_DOC.replace("\n", " ")
    (rule,) = re.findall(r"^ACL SETUSER gateway (.+)$", REDIS_DOC, re.M)
    words = [w.replace("PASSWORD", "t-pw") for w in rule.split()] + CLUSTER_ACL.split()
    for node in empty_cluster.nodes:
        with empty_cluster.client(node) as admin:
            admin.execute_command("ACL", "SETUSER", "gateway", *words)
            admin.execute_command("ACL", "LOG", "RESET")
    url = f"redis://gateway:t-pw@127.0.0.1:{empty_cluster.nodes[0].port}"
    inspect = connect(url, command_timeout_s=2.0)
    config = parse_config(CONFIG, "t.yaml")
    fleet = Fleet(config, Registry(config.models), inspect, store="cluster", cluster=empty_cluster)
    fleet.url = url
    try:
        spool = UsageSpool(UsageSettings(spool_dir=str(tmp_path)), url)
        adm = await fleet.admission(spool=spool)
        keeper = await fleet.keeper(adm)
        admitted = await admit(adm, fleet.plan("two", "five"))
        await bounded(adm.release(admitted.lease, usage_record(request_id="t-acl").to_fields()))
        await bounded(keeper.sweep_once())
        assert await bounded(probe(inspect, 3.0)) is None
        assert len(cast(StreamEntries, await inspect.xrange("usage"))) == 1
        assert spool.size_bytes() == 0
    finally:
        await fleet.close()
        await inspect.aclose()
        for node in empty_cluster.nodes:
            with empty_cluster.client(node) as admin:
                denied = admin.execute_command("ACL", "LOG")
                admin.execute_command("ACL", "DELUSER", "gateway")
            assert denied == [], denied
