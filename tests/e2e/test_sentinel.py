"""Redis behind Sentinel, for real (issue 13): a master, its replica and a Sentinel on
loopback, a `gateway serve` on the `redis+sentinel://` URL, and `SENTINEL FAILOVER` in the
middle of bounded traffic. The gateway follows the new master within seconds, requests
succeed again, and the invariants hold: the worker never ran more than its capacity, one
usage record per admitted request in the new master, nothing held in it afterwards.

The master refuses writes once its replica is gone (`min-replicas-to-write 1`, as
docs/config.md advises): Sentinel promotes the replica seconds before it demotes the old
master, and a write the old master took meanwhile would be lost with it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast
from urllib.parse import quote

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.e2e.test_faults import leftovers, rid, until, worker_load
from tests.redis_server import RedisServer, StreamEntries, free_port

KEY = "sk-sentinel"
PASSWORD = "s3cret:/@"
AUTH = ["--requirepass", PASSWORD, "--masterauth", PASSWORD]
CAPACITY = 4
LEASE_TTL_S = 3
SLACK_S = 5.0
# Bounds on what the test waits for (a busy 2-core machine): Sentinel's own steps
# (it finds the replica through the master's INFO every 10 s) and the gateway's.
SENTINEL_READY_S = 30.0
FOLLOW_S = 20.0


@dataclass
class Nodes:
    master: RedisServer
    replica: RedisServer
    sentinel: RedisServer

    @property
    def url(self) -> str:
        # The data nodes' password; a first sentinel that is down: the next one is asked.
        sentinels = f"127.0.0.1:{free_port()},127.0.0.1:{self.sentinel.port}"
        return f"redis+sentinel://:{quote(PASSWORD, safe='')}@{sentinels}/gw/0"

    def master_port(self) -> int:
        with redis.Redis(port=self.sentinel.port, socket_timeout=5) as s:
            _, port = s.execute_command("SENTINEL", "get-master-addr-by-name", "gw")
        return int(port)


def config(url: str, worker: procs.Proc) -> str:
    return f"""
redis: {{url: "{url}", lease_ttl_s: {LEASE_TTL_S}, command_timeout_s: 0.5}}
tiers:
  default: {{queue_timeout_s: 10}}
models:
  m: {{endpoints: [{{url: "{worker.url}", max_concurrency: {CAPACITY}, model: m1}}]}}
keys: [{{sha256: "{digest(KEY)}", account: sentinel}}]
"""


def _replica_known(sentinel: RedisServer) -> bool:
    with redis.Redis(port=sentinel.port, socket_timeout=5, decode_responses=True) as s:
        replicas = s.execute_command("SENTINEL", "REPLICAS", "gw")
    return any(
        "s_down" not in str(r) and "master-link-status" in str(r) and "'ok'" in str(r)
        for r in replicas
    )


@contextmanager
def sentinel_nodes(tmp_path: Path, master_extra: Sequence[str]) -> Iterator[Nodes]:
    """A master (with `master_extra`), its replica and a Sentinel that fails over a second
    after the master stops answering, the replica known to it; all stopped after."""
    started: list[RedisServer] = []
    try:
        master = RedisServer(tmp_path, extra=[*AUTH, *master_extra]).start()
        started.append(master)
        replica = RedisServer(tmp_path, extra=[*AUTH, "--replicaof", "127.0.0.1", str(master.port)])
        started.append(replica.start())
        # The sentinel needs the data nodes' password to watch them; the gateway does not
        # give one to the sentinel.
        auth = ["--sentinel", "auth-pass", "gw", PASSWORD]
        sentinel = RedisServer(tmp_path, sentinel=True, monitor=master.port, extra=auth)
        started.append(sentinel.start())
        with redis.Redis(port=sentinel.port, socket_timeout=5) as s:
            s.execute_command("SENTINEL", "SET", "gw", "down-after-milliseconds", "1000",
                              "failover-timeout", "3000")  # fmt: skip
        deadline = time.monotonic() + SENTINEL_READY_S
        while not _replica_known(sentinel):  # no event across processes: a bounded poll
            assert time.monotonic() < deadline, "the sentinel never saw the replica"
            time.sleep(0.1)
        yield Nodes(master, replica, sentinel)
    finally:
        for server in reversed(started):
            server.stop()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    with sentinel_nodes(
        tmp_path, ["--min-replicas-to-write", "1", "--min-replicas-max-lag", "10"]
    ) as found:
        yield found


@dataclass
class Traffic:
    url: str
    stop: asyncio.Event
    outcomes: list[tuple[str, int, float]]  # request id, status, when it ended

    async def loop(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            headers = {"Authorization": f"Bearer {KEY}"}
            while not self.stop.is_set():
                request = rid("sentinel")
                body = {"model": "m", "prompt": "x", "max_tokens": 2}
                answer = await client.post(
                    "/v1/completions", json=body, headers={**headers, "x-request-id": request}
                )
                self.outcomes.append((request, answer.status_code, time.monotonic()))

    def ok_since(self, since: float) -> int:
        return sum(1 for _, status, at in self.outcomes if status == 200 and at > since)


async def _usage(port: int) -> Counter[str]:
    client = aioredis.Redis(port=port, password=PASSWORD, socket_timeout=5)
    try:
        entries = cast(StreamEntries, await client.xrange("usage"))
        return Counter(f[b"request_id"].decode() for _, f in entries)
    finally:
        await client.aclose()


async def _readyz(gateway: procs.Proc) -> int:
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(gateway.url + "/readyz")).status_code


async def _ready(gateway: procs.Proc) -> bool:
    return await _readyz(gateway) == 200


async def _spool_empty(gateway: procs.Proc) -> bool:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(gateway.url + "/metrics")).text
    lines = [ln for ln in text.splitlines() if ln.startswith("gateway_usage_spool_bytes ")]
    return bool(lines) and float(lines[0].split()[1]) == 0


async def test_the_gateway_follows_a_sentinel_failover(nodes: Nodes, tmp_path: Path) -> None:
    started: list[procs.Proc] = []
    try:
        # The worker would take twice the capacity: over-admission would show in its counters.
        worker = procs.sim(tmp_path, "--max-seqs", str(2 * CAPACITY), "--ttft-ms", "5",
                           "--itl-ms", "5", "--tokens", "4")  # fmt: skip
        started.append(worker)
        gateway = procs.gateway(tmp_path, config(nodes.url, worker))
        started.append(gateway)
        assert (await _readyz(gateway)) == 200  # ROLE and EVALSHA on the master found
        traffic = Traffic(gateway.url, asyncio.Event(), [])
        loops = [asyncio.create_task(traffic.loop()) for _ in range(2 * CAPACITY)]
        try:
            await until(_ok(traffic, 0.0, 20), "requests through the first master", FOLLOW_S)
            old = nodes.master_port()
            with redis.Redis(port=nodes.sentinel.port, socket_timeout=5) as s:
                assert s.execute_command("SENTINEL", "FAILOVER", "gw")
            switched = time.monotonic()
            await until(_moved(nodes, old), "the sentinel to name the replica", FOLLOW_S)
            await until(_ok(traffic, switched, 20), "requests through the new master", FOLLOW_S)
        finally:
            traffic.stop.set()
            await asyncio.wait_for(asyncio.gather(*loops), 60)
        new = nodes.master_port()
        await until(lambda: _ready(gateway), "/readyz on the new master", SLACK_S)
        assert new == nodes.replica.port
        statuses = Counter(status for _, status, _ in traffic.outcomes)
        assert set(statuses) <= {200, 503}, statuses  # an outage answer while it moves
        load = worker_load(worker)
        assert load["sim:peak_requests_running"] <= CAPACITY, load
        assert load["sim:peak_requests_waiting"] == 0, load
        await until(lambda: _spool_empty(gateway), "the usage spool to empty", 10 + SLACK_S)
        admitted = {request for request, status, _ in traffic.outcomes if status == 200}
        records = await _usage(new)
        assert Counter({r: n for r, n in records.items() if r in admitted}) == Counter(admitted)
        assert all(n == 1 for n in records.values()), records.most_common(3)
        refused = {request for request, status, _ in traffic.outcomes if status != 200}
        assert not refused & set(records), refused & set(records)
        left: list[str] = []

        async def clean() -> bool:
            url = f"redis://:{quote(PASSWORD, safe='')}@127.0.0.1:{new}/0"
            left[:] = await leftovers(url, ("m",))
            return not left

        await until(clean, f"the new master to hold nothing ({left})", LEASE_TTL_S + SLACK_S)
    finally:
        for proc in reversed(started):
            proc.stop()


def _ok(traffic: Traffic, since: float, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return traffic.ok_since(since) >= count

    return check


def _moved(nodes: Nodes, old: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await asyncio.to_thread(nodes.master_port) != old

    return check
