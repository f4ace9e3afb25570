"""The gateway on a Redis Cluster, seen from outside: given one node's address, it finds the
others by itself; keys made by `gateway keys create`, requests for models whose slots live
on each of the three masters, one usage record each that `gateway usage export` reads back,
nothing left in the spool, and /readyz ready."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e import procs
from tests.e2e.conftest import keys_create
from tests.e2e.test_usage import records_for, wait_for
from tests.redis_cluster import RedisCluster

MODELS = ("cap5", "q1", "cap2")  # one per master of the run's cluster (asserted)
RUN = uuid.uuid4().hex[:8]


def cluster_config(worker: procs.Proc, cluster: RedisCluster, tmp: Path) -> str:
    models = "".join(
        f'  {m}:\n    endpoints: [{{url: "{worker.url}", max_concurrency: 4, model: m1}}]\n'
        for m in MODELS
    )
    # Any node's address will do: the last one's, not the one tests read through.
    return (
        f'redis: {{url: "{cluster.urls()[-1]}"}}\n'
        f'usage: {{spool_dir: "{tmp}/spool"}}\nmodels:\n{models}'
    )


@pytest.fixture(scope="module")
def gateway(
    redis_cluster: RedisCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[procs.Proc, Path]]:
    redis_cluster.flush()
    nodes = {m: redis_cluster.node_of("{" + m + "}").port for m in MODELS}
    assert len(set(nodes.values())) == 3, nodes
    tmp = tmp_path_factory.mktemp("cluster")
    started: list[procs.Proc] = []
    try:
        worker = procs.sim(tmp, "--ttft-ms", "0", "--itl-ms", "1", "--tokens", "4")
        started.append(worker)
        gw = procs.gateway(tmp, cluster_config(worker, redis_cluster, tmp))
        started.append(gw)
        yield gw, tmp / f"gateway-{gw.port}.yaml"
    finally:
        for proc in started:
            proc.stop()


def test_requests_on_every_node_are_served_and_billed_once(
    gateway: tuple[procs.Proc, Path],
) -> None:
    gw, config = gateway
    key = keys_create(config, "--account", "cluster-acct", "--max-concurrency", "8")
    served = set()
    for i in range(30):
        rid = f"cluster-{RUN}-{i}"
        r = httpx.post(
            gw.url + "/v1/completions", timeout=30,
            headers={"Authorization": f"Bearer {key}", "x-request-id": rid},
            json={"model": MODELS[i % 3], "prompt": "x", "max_tokens": 2},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        served.add(rid)
    wait_for(lambda: all(len(v) == 1 for v in records_for(config, served).values()),
             "every request's record, once", 20)  # fmt: skip
    assert "gateway_usage_spool_bytes 0.0" in httpx.get(gw.url + "/metrics", timeout=10).text
    assert httpx.get(gw.url + "/readyz", timeout=10).status_code == 200
    unknown = httpx.post(
        gw.url + "/v1/completions", timeout=30, headers={"Authorization": "Bearer sk-nope"},
        json={"model": "cap5", "prompt": "x", "max_tokens": 2},
    )  # fmt: skip
    assert unknown.status_code == 401
