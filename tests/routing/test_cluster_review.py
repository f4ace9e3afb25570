"""Review findings on the Cluster store: each test shows one defect (xfail until fixed)."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
from redis.exceptions import RedisError

from gateway.settings import parse_config
from routing.cluster import ClusterStore
from routing.errors import Unavailable
from routing.registry import Registry
from routing.resp import NotSent
from routing.store import connect
from tests.redis_cluster import start_cluster
from tests.redis_server import RedisServer
from tests.routing.test_admission import CONFIG, Fleet, admit, bounded


async def _until_not_sent(store: ClusterStore, node: RedisServer) -> None:
    """Until the cluster store's client of `node` (killed) answers NotSent: it saw the
    connection go (an event of its own loop, not a timing)."""
    while True:
        try:
            await store.node(("127.0.0.1", node.port)).send([["PING"]])
        except NotSent:
            return
        except RedisError:  # the lost connection's own error first
            continue


async def test_noscript_on_one_master_with_another_down_gives_back_what_ran(
    tmp_path: Path,
) -> None:
    # One master restarted (its scripts gone: NOSCRIPT there only) while another is down:
    # reloading the scripts fails with NotSent (SCRIPT LOAD goes to every master), and the
    # whole batch then failed as NotSent ("nothing ran, nothing to undo") although the
    # account call on a third master ran: its entry stayed held until its TTL.
    cluster = start_cluster(tmp_path / "c", ["--cluster-require-full-coverage", "no"])
    config = parse_config(CONFIG, "t.yaml")
    inspect = connect(cluster.url, command_timeout_s=2.0)
    fleet = Fleet(config, Registry(config.models), inspect, store="cluster", cluster=cluster)
    try:
        model_node = cluster.node_of("{two}")
        account = next(
            f"t-r{i}"
            for i in range(1000)
            if cluster.node_of("{t-r" + str(i) + "}") is not model_node
        )
        account_node = cluster.node_of("{" + account + "}")
        down = next(n for n in cluster.nodes if n not in (model_node, account_node))
        adm = await fleet.admission()
        down.kill()
        await bounded(_until_not_sent(cast(ClusterStore, adm.store), down))
        with cluster.client(model_node) as client:
            client.script_flush()
        with pytest.raises(Unavailable):
            await admit(adm, fleet.plan("two"), account=account)
        await bounded(adm.drain())
        with cluster.client(account_node) as client:
            assert client.zcard("gw:acct:{" + account + "}") == 0, "the account entry leaked"
    finally:
        await fleet.close()
        await inspect.aclose()
        cluster.stop()
