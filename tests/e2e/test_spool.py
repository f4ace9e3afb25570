"""The usage spool from outside (docs/usage.md): gateway processes sharing one spool directory,
each on its own Redis, killed, restarted, and facing a full Redis. A record reaches only
the Redis of the gateway that admitted its request, exactly once."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.redis_server import RedisServer

KEY = "sk-spool"
AUTH = {"Authorization": f"Bearer {KEY}"}
RUN = uuid.uuid4().hex[:8]
# A Lua script may go on writing past maxmemory once it has written (here a DEL): the test's
# way to put a Redis over its limit, where noeviction refuses every new denyoom write.
OVERFILL = (
    "redis.call('DEL', 'filler:none') "
    "for i = 1, tonumber(ARGV[1]) do redis.call('SET', 'filler:' .. i, string.rep('x', 10000)) end"
)
FILLERS = 300  # 3 MB on a 2 MB limit: well over it


def overfill(client: redis.Redis) -> None:
    client.eval(OVERFILL, 0, FILLERS)
    with pytest.raises(redis.ResponseError, match="maxmemory"):
        client.set("probe", "x")


def config(worker: procs.Proc, redis_url: str, spool_dir: Path, on_outage: str = "local") -> str:
    return (
        f'redis: {{url: "{redis_url}", lease_ttl_s: 5, on_outage: {on_outage}}}\n'
        f'usage: {{spool_dir: "{spool_dir}"}}\n'
        "models:\n  m:\n"
        f'    endpoints: [{{url: "{worker.url}", max_concurrency: 8, model: m1}}]\n'
        f'keys: [{{sha256: "{digest(KEY)}", account: spool}}]\n'
    )


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[procs.Proc]:
    tmp = tmp_path_factory.mktemp("spool-worker")
    # Slow enough that a stream is still running when the test fills Redis up.
    sim = procs.sim(tmp, "--ttft-ms", "0", "--itl-ms", "40", "--tokens", "25")
    try:
        yield sim
    finally:
        sim.stop()


def complete(gateway: procs.Proc, rid: str) -> int:
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    headers = {**AUTH, "x-request-id": rid}
    return httpx.post(
        gateway.url + "/v1/completions", json=body, headers=headers, timeout=30
    ).status_code


def metric(gateway: procs.Proc, sample: str) -> float:
    for line in httpx.get(gateway.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not exported")


def recorded(server: RedisServer) -> Counter[str]:
    """How many times each request id is in the server's stream `usage`."""
    with redis.Redis.from_url(server.url) as client:
        return Counter(d[b"request_id"].decode() for _, d in client.xrange("usage"))


def wait_for(check: Callable[[], bool], what: str, limit_s: float = 20.0) -> None:
    """Another process's state has no event to wait on: poll it, bounded in time."""
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def served(gateway: procs.Proc, name: str, count: int) -> list[str]:
    rids = [f"spool-{RUN}-{name}-{i}" for i in range(count)]
    assert [complete(gateway, rid) for rid in rids] == [200] * count
    return rids


class Stops:
    """Processes and servers a test started, stopped however it ends."""

    def __init__(self) -> None:
        self.stops: list[Callable[[], object]] = []

    def gateway(self, tmp: Path, text: str) -> procs.Proc:
        started = procs.gateway(tmp, text)
        self.stops.append(started.stop)
        return started

    def redis(self, tmp: Path, maxmemory: str | None = None) -> RedisServer:
        server = RedisServer(tmp, maxmemory=maxmemory).start()
        self.stops.append(server.stop)
        return server

    def close(self) -> None:
        for stop in reversed(self.stops):
            stop()


@pytest.fixture
def stops() -> Iterator[Stops]:
    made = Stops()
    try:
        yield made
    finally:
        made.close()


def test_two_gateways_on_one_host_keep_their_records_apart(
    worker: procs.Proc, stops: Stops, tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"  # one directory for both, as one $TMPDIR on one host
    redis_a, redis_b = stops.redis(tmp_path), stops.redis(tmp_path)
    gw_a = stops.gateway(tmp_path, config(worker, redis_a.url, spool_dir))
    gw_b = stops.gateway(tmp_path, config(worker, redis_b.url, spool_dir))
    redis_a.kill()
    redis_b.kill()
    sent_a, sent_b = served(gw_a, "a", 5), served(gw_b, "b", 5)  # on_outage: local
    assert metric(gw_a, "gateway_usage_spool_bytes") > 0
    assert metric(gw_b, "gateway_usage_spool_bytes") > 0

    # B's Redis comes back first: B's rounds (adoption, then its own spool) run while A's
    # records wait beside B's in the same directory.
    redis_b.start()
    wait_for(lambda: recorded(redis_b) == Counter(sent_b), "B's records in B's Redis")
    wait_for(lambda: metric(gw_b, "gateway_usage_stream_length") == 5, "a full round of B")
    assert metric(gw_a, "gateway_usage_spool_bytes") > 0  # A's records: still A's

    redis_a.start()
    wait_for(lambda: recorded(redis_a) == Counter(sent_a), "A's records in A's Redis")
    wait_for(lambda: metric(gw_a, "gateway_usage_spool_bytes") == 0, "A's spool to empty")
    assert recorded(redis_a) == Counter(sent_a)  # each exactly once, none of B's
    assert recorded(redis_b) == Counter(sent_b)
    assert metric(gw_a, "gateway_usage_records_lost_total") == 0
    assert metric(gw_b, "gateway_usage_records_lost_total") == 0


def test_a_restarted_gateway_sends_what_its_predecessor_left(
    worker: procs.Proc, stops: Stops, tmp_path: Path
) -> None:
    spool_dir = tmp_path / "spool"
    redis_s, redis_t = stops.redis(tmp_path), stops.redis(tmp_path)
    first = stops.gateway(tmp_path, config(worker, redis_s.url, spool_dir))
    redis_s.kill()
    left = served(first, "left", 4)
    wait_for(lambda: metric(first, "gateway_usage_spool_bytes") > 0, "the records spooled")
    first.stop(signal.SIGKILL)
    (spool,) = spool_dir.glob("gateway-usage-*.jsonl")
    assert len(spool.read_bytes().splitlines()) == 4
    with spool.open("ab") as out:  # as if killed during an append
        out.write(b'{"request_id": "torn-' + RUN.encode())

    # A gateway of another store, on the same directory, leaves them alone.
    other = stops.gateway(tmp_path, config(worker, redis_t.url, spool_dir))
    mine = served(other, "other", 1)
    wait_for(lambda: metric(other, "gateway_usage_stream_length") == 1, "a full round of it")
    assert recorded(redis_t) == Counter(mine)
    assert len(spool.read_bytes().splitlines()) == 5

    # The restarted gateway of the same store (and Redis) sends them, exactly once.
    redis_s.start()
    second = stops.gateway(tmp_path, config(worker, redis_s.url, spool_dir))
    wait_for(lambda: recorded(redis_s) == Counter(left), "the predecessor's records")
    wait_for(lambda: not spool.exists(), "the adopted spool to be deleted")
    assert not spool.with_suffix(".lock").exists()
    assert metric(second, "gateway_usage_spool_bad_lines_total") == 1
    assert metric(second, 'gateway_background_errors_total{task="spool"}') == 0
    (bad,) = spool_dir.glob("gateway-usage-*.bad")
    assert bad.read_bytes().startswith(b'{"request_id": "torn-')
    assert recorded(redis_s) == Counter(left)
    assert recorded(redis_t) == Counter(mine)


def test_records_wait_while_redis_is_full_and_arrive_once(
    worker: procs.Proc, stops: Stops, tmp_path: Path
) -> None:
    small = stops.redis(tmp_path, maxmemory="2mb")
    gateway = stops.gateway(tmp_path, config(worker, small.url, tmp_path / "spool", "reject"))
    rids = [f"spool-{RUN}-full-{i}" for i in range(3)]
    started = threading.Barrier(len(rids) + 1)
    streams = [
        threading.Thread(target=stream_through, args=(gateway, rid, started)) for rid in rids
    ]
    for thread in streams:
        thread.start()
    started.wait(timeout=30)  # all admitted and streaming: now Redis fills up
    with redis.Redis.from_url(small.url) as client:
        overfill(client)
        for thread in streams:
            thread.join(timeout=30)
        # Their releases carried the records: refused (OOM), so spooled, not lost.
        wait_for(lambda: metric(gateway, "gateway_usage_spool_bytes") > 0, "the records spooled")
        assert recorded(small) == Counter()
        assert metric(gateway, "gateway_usage_records_lost_total") == 0

        client.delete(*(f"filler:{i}" for i in range(1, FILLERS + 1)))
    wait_for(lambda: recorded(small) == Counter(rids), "the records once Redis has room")
    wait_for(lambda: metric(gateway, "gateway_usage_spool_bytes") == 0, "the spool to empty")
    assert recorded(small) == Counter(rids)


def stream_through(gateway: procs.Proc, rid: str, started: threading.Barrier) -> None:
    body = {"model": "m", "prompt": "x", "stream": True}
    headers = {**AUTH, "x-request-id": rid}
    url = gateway.url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as response:
        assert response.status_code == 200
        chunks = response.iter_bytes()
        next(chunks)
        started.wait(timeout=30)
        for _ in chunks:
            pass


def test_admission_answers_while_redis_is_full(
    worker: procs.Proc, stops: Stops, tmp_path: Path
) -> None:
    small = stops.redis(tmp_path, maxmemory="2mb")
    gateway = stops.gateway(tmp_path, config(worker, small.url, tmp_path / "spool", "reject"))
    with redis.Redis.from_url(small.url) as client:
        overfill(client)
        rids = [f"spool-{RUN}-admit-{i}" for i in range(3)]
        assert [complete(gateway, rid) for rid in rids] == [200] * 3
        wait_for(lambda: metric(gateway, "gateway_usage_spool_bytes") > 0, "the records spooled")
        client.delete(*(f"filler:{i}" for i in range(1, FILLERS + 1)))
    wait_for(lambda: recorded(small) == Counter(rids), "the records once Redis has room")
