"""Redis goes away under a running gateway: readiness, on_outage, admitted requests finish."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.redis_server import RedisServer

KEY = "sk-outage"


def config(redis_port: int, sim: procs.Proc, on_outage: str) -> str:
    return f"""
redis: {{url: "redis://127.0.0.1:{redis_port}/0", lease_ttl_s: 5, on_outage: {on_outage}}}
models:
  m: {{endpoints: [{{url: "{sim.url}", max_concurrency: 4, model: m1}}]}}
keys: [{{sha256: "{digest(KEY)}", account: outage}}]
"""


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RedisServer, list[procs.Proc]]]:
    tmp = tmp_path_factory.mktemp("outage")
    server = RedisServer(tmp)
    server.start()
    started: list[procs.Proc] = []
    try:
        sim = procs.sim(tmp, "--ttft-ms", "0", "--itl-ms", "20", "--tokens", "40")
        started.append(sim)
        started.append(procs.gateway(tmp, config(server.port, sim, "reject")))
        started.append(procs.gateway(tmp, config(server.port, sim, "local")))
        yield server, started
    finally:
        for proc in started:
            proc.stop()
        server.stop()


def test_outage_and_recovery(setup: tuple[RedisServer, list[procs.Proc]]) -> None:
    server, (_, reject, local) = setup
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

        # on_outage: local admits against this replica's share (4 slots, one live replica).
        assert client.post(local.url + "/v1/completions", json=body).status_code == 200

        server.start()
        deadline = time.monotonic() + 10
        while httpx.get(reject.url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, "readiness did not come back"
            time.sleep(0.05)
        assert client.post(reject.url + "/v1/completions", json=body).status_code == 200
