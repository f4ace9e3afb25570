"""Redis goes away under a running gateway: readiness, on_outage, admitted requests finish.

On a single Redis and on a 3-master Redis Cluster of the test's own, where the master of
model m goes away: m is the outage there, the model `live` and the account (on the two other
masters, asserted) go on, as docs/architecture.md says."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from routing.store.keys import account_key
from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.redis_cluster import start_cluster
from tests.redis_server import RedisServer

KEY = "sk-outage"


def config(redis_url: str, sim: procs.Proc, on_outage: str) -> str:
    return f"""
redis: {{url: "{redis_url}", lease_ttl_s: 5, on_outage: {on_outage}}}
models:
  m: {{endpoints: [{{url: "{sim.url}", max_concurrency: 4, model: m1}}]}}
  live: {{endpoints: [{{url: "{sim.url}", max_concurrency: 4, model: m1}}]}}
keys: [{{sha256: "{digest(KEY)}", account: outage-acct-0}}]
"""


@dataclass
class Outage:
    down: RedisServer  # the single Redis, or the Cluster master of m
    cluster: bool
    replicas: list[procs.Proc]  # on_outage: reject, then local


@pytest.fixture(scope="module", params=["single", "cluster"])
def setup(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Outage]:
    tmp = tmp_path_factory.mktemp("outage")
    servers: list[RedisServer] = []
    started: list[procs.Proc] = []
    try:
        down, url = store(tmp, request.param, servers)
        sim = procs.sim(tmp, "--ttft-ms", "0", "--itl-ms", "20", "--tokens", "40")
        started.append(sim)
        started += [procs.gateway(tmp, config(url, sim, mode)) for mode in ("reject", "local")]
        yield Outage(down, request.param == "cluster", started[1:])
    finally:
        for proc in started:
            proc.stop()
        for server in servers:
            server.stop()


def store(tmp: Path, kind: str, servers: list[RedisServer]) -> tuple[RedisServer, str]:
    """The server to take away and the address the gateways are given (on a Cluster, another
    master's); every server started is added to `servers`."""
    if kind == "single":
        servers.append(RedisServer(tmp).start())
        return servers[0], servers[0].url
    # A master down stops only its own slots (docs/redis.md); no node is marked failed
    # within the test (node timeout 60 s): the run is the same however long it takes.
    extra = ["--cluster-require-full-coverage", "no", "--cluster-node-timeout", "60000"]
    cluster = start_cluster(tmp / "cluster", extra)
    servers += cluster.nodes
    down = cluster.node_of("{m}")
    others = {cluster.node_of("{live}").port, cluster.node_of(account_key("outage-acct-0")).port}
    assert len({down.port, *others}) == 3
    return down, next(
        u for n, u in zip(cluster.nodes, cluster.urls(), strict=True) if n is not down
    )


def test_outage_and_recovery(setup: Outage) -> None:
    server, (reject, local) = setup.down, setup.replicas
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    assert httpx.get(reject.url + "/readyz").status_code == 200
    with httpx.Client(timeout=30, headers=headers) as client:
        long = {"model": "m", "prompt": "x", "stream": True}
        with client.stream("POST", reject.url + "/v1/completions", json=long) as stream:
            chunks = stream.iter_text()
            next(chunks)
            server.kill()
            rest = "".join(chunks)  # the admitted stream finishes although Redis is gone
        assert rest.rstrip().endswith("data: [DONE]")

        ready = httpx.get(reject.url + "/readyz")
        assert ready.status_code == 503 and "redis" in ready.json()["reason"]
        refused = client.post(reject.url + "/v1/completions", json=body)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "service_unavailable"
        assert "Redis" in refused.json()["error"]["message"]
        # On a Cluster the other masters' model goes on; a single Redis down stops all.
        other = client.post(reject.url + "/v1/completions", json={**body, "model": "live"})
        assert other.status_code == (200 if setup.cluster else 503), other.text

        # on_outage: local admits against this replica's share (4 slots, one live replica).
        assert client.post(local.url + "/v1/completions", json=body).status_code == 200

        server.start()  # empty; a Cluster node comes back knowing its slots
        deadline = time.monotonic() + 10
        while httpx.get(reject.url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, "readiness did not come back"
            time.sleep(0.05)
        assert client.post(reject.url + "/v1/completions", json=body).status_code == 200
