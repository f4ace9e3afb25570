"""A rolling update across the change of waiter liveness (docs/architecture.md, "Waiting"):
a replica of the release before it (whose sweeps name every waiter, whose grants are said
without their time) and one of this release share Redis and the queue of q (capacity 1).
Waiters of both are granted by both; q never runs two, every waiter is served, nothing is
left in Redis.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from tests.e2e import procs
from tests.e2e.test_faults import KEY, KEY_ONE, KEY_TWO, held, long_sim, post, until
from tests.e2e.test_faults import worker_load as load
from tests.e2e.test_waiter_liveness import clean, one_slot, queued, settle, stop_all
from tests.redis_server import RedisServer, free_port

# The release before waiters lived by their replica's word.
BEFORE = "4f4b0e8"
ROOT = Path(__file__).resolve().parents[2]
LEASE_TTL_S = 6
QUEUE = "gw:{q}:queue"


@dataclass
class OldProc(procs.Proc):
    """A gateway of the release before, run from its own tree."""

    cwd: Path = ROOT

    def start(self) -> OldProc:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(self.cwd)}
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "gateway", *self.args],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
            )  # fmt: skip
        self._wait_ready()
        return self


def old_tree(tmp: Path) -> Path:
    tree = tmp / "before"
    tree.mkdir()
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", BEFORE, "gateway", "routing", "tiers"],
            check=True, capture_output=True, timeout=60,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"the release before ({BEFORE}) is not in this checkout: {exc}")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True, timeout=60)
    return tree


@dataclass
class Mixed:
    redis: RedisServer
    old: procs.Proc
    new: procs.Proc
    single: procs.Proc


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mixed]:
    tmp: Path = tmp_path_factory.mktemp("rolling")
    tree = old_tree(tmp)
    server = RedisServer(tmp).start()
    started: list[procs.Proc] = []
    try:
        single = long_sim(tmp, 4)
        started.append(single)
        config = one_slot(server.url, single.url, LEASE_TTL_S, 0.5)
        port = free_port()
        path = tmp / f"old-{port}.yaml"
        path.write_text(config)
        args = ["serve", "--config", str(path), "--port", str(port), "--host", "127.0.0.1"]
        old = OldProc(args, port, "/healthz", tmp / f"old-{port}.log", cwd=tree).start()
        started.append(old)
        new = procs.gateway(tmp, config)
        started.append(new)
        yield Mixed(server, old, new, single)
    finally:
        stop_all(started, server)


@pytest.mark.parametrize("first", ["old"])  # ("new" too held: left out for the suite's time)
async def test_waiters_of_both_releases_are_served_in_turn(mixed: Mixed, first: str) -> None:
    """q held on one replica; waiters alternate between the releases (8 in all), each run
    a little while, so each release grants to the other's waiters. All are served (200),
    q never runs two, nothing is left."""
    replicas = [mixed.old, mixed.new] if first == "old" else [mixed.new, mixed.old]
    client = aioredis.from_url(mixed.redis.url)
    keys = [KEY, KEY_TWO, KEY, KEY_ONE]  # faults-two twice, faults-one once at most
    tasks: list[asyncio.Task[httpx.Response]] = []
    try:
        async with held(replicas[0].url, "q"):
            for n in range(1, 9):
                url = replicas[n % 2].url
                tasks.append(
                    asyncio.create_task(
                        post(url, "q", key=keys[n % 4] if n < 5 else KEY, max_tokens=30)
                    )
                )
                await until(lambda n=n: queued(client, n), f"waiter {n}", 5)
        answers = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        await settle(tasks, client)
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
    assert load(mixed.single)["sim:peak_requests_running"] <= 1
    await clean(mixed.redis.url, LEASE_TTL_S + 3)


async def test_a_new_replica_stopped_among_old_ones_never_runs_two(mixed: Mixed) -> None:
    """q held on the old replica; the new one queues, then the old, then the new again; the
    new one is stopped past the claim time as the stream ends (the old one's untimed grant
    to the new waiter goes back and its slot is taken). Resumed, q never runs two, every
    request ends 200 or 429, nothing is left."""
    old, new = mixed.old, mixed.new
    assert new.popen is not None
    client = aioredis.from_url(mixed.redis.url)
    tasks: list[asyncio.Task[httpx.Response]] = []
    try:
        async with held(old.url, "q"):
            for n, (url, key) in enumerate(
                [(new.url, KEY_TWO), (old.url, KEY), (new.url, KEY_ONE)]
            ):
                tasks.append(asyncio.create_task(post(url, "q", key=key, max_tokens=200)))
                await until(lambda n=n: queued(client, n + 1), f"waiter {n}", 5)
            new.popen.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(6.0)
        finally:
            new.popen.send_signal(signal.SIGCONT)
        answers = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        await settle(tasks, client)
    codes = [r.status_code for r in answers]
    print(codes)
    assert all(c in (200, 429) for c in codes), [r.text for r in answers]
    assert load(mixed.single)["sim:peak_requests_running"] <= 1
    await clean(mixed.redis.url, LEASE_TTL_S + 3)
