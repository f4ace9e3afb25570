"""A gateway replica stopped (SIGSTOP: a stalled host, a paused container) for longer than
the claim time but shorter than the lease TTL, then resumed; the guarantees under faults read
from the workers' own counters and from Redis itself. The leases of what it runs stay in Redis
all along (the lease TTL has not passed): its requests are still in flight, at the
workers, and every limit must go on counting them.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis.asyncio as aioredis

from routing.admission.timing import Timing
from routing.store.keys import account_key
from tests.e2e import procs
from tests.e2e.test_faults import (
    KEY_ONE,
    KEY_TWO,
    KEYS_YAML,
    held,
    leftovers,
    long_sim,
    post,
    until,
    worker_load,
)
from tests.redis_server import RedisServer, ScoredMembers

LEASE_TTL_S = 6
COMMAND_TIMEOUT_S = 0.5
SWEEP_S = min(1.0, LEASE_TTL_S / 4)
TIMING = Timing.of(LEASE_TTL_S, SWEEP_S, COMMAND_TIMEOUT_S)
CLAIM_S = TIMING.claim_ms / 1000  # 4 s
WAITER_TTL_S = TIMING.waiter_ttl_ms / 1000  # 3 s
SLACK_S = 3.0


@dataclass
class Stopped:
    redis: RedisServer
    replicas: list[procs.Proc]
    worker: procs.Proc  # m: one endpoint of 2 (it would take 8)
    single: procs.Proc  # q: one endpoint of 1 (it would take 4)
    spare: procs.Proc  # free: one of 100
    config: str
    tmp: Path

    @property
    def url(self) -> str:
        return self.redis.url


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stopped]:
    tmp: Path = tmp_path_factory.mktemp("stopped")
    server = RedisServer(tmp).start()
    started: list[procs.Proc] = []
    try:
        worker, single, spare = long_sim(tmp, 8), long_sim(tmp, 4), long_sim(tmp, 200)
        started += [worker, single, spare]
        config = f"""
redis: {{url: "{server.url}", lease_ttl_s: {LEASE_TTL_S}, command_timeout_s: {COMMAND_TIMEOUT_S}}}
tiers:
  default: {{queue_timeout_s: 30}}
models:
  m: {{endpoints: [{{url: "{worker.url}", max_concurrency: 2, model: m1}}]}}
  q: {{endpoints: [{{url: "{single.url}", max_concurrency: 1, model: m1}}]}}
  free: {{endpoints: [{{url: "{spare.url}", max_concurrency: 100, model: m1}}]}}
{KEYS_YAML}"""
        replicas = [procs.gateway(tmp, config) for _ in range(2)]
        started += replicas
        yield Stopped(server, replicas, worker, single, spare, config, tmp)
    finally:
        for proc in started:
            if proc.popen is not None and proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)  # one left stopped by a failed test
            proc.stop()
        server.stop()


@asynccontextmanager
async def sigstopped(replica: procs.Proc) -> AsyncIterator[None]:
    assert replica.popen is not None
    replica.popen.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        replica.popen.send_signal(signal.SIGCONT)


async def redis_ms(fleet: Stopped) -> int:
    client = aioredis.from_url(fleet.url)
    try:
        seconds, micros = await client.time()
        return int(seconds) * 1000 + int(micros) // 1000
    finally:
        await client.aclose()


async def score(fleet: Stopped, key: str) -> float | None:
    """The score of `key`'s one member (an expiry), None if it has none."""
    client = aioredis.from_url(fleet.url)
    try:
        found = await client.zrange(key, 0, -1, withscores=True)
        assert len(found) <= 1, found
        return float(found[0][1]) if found else None
    finally:
        await client.aclose()


async def clean(fleet: Stopped, limit_s: float = LEASE_TTL_S + SLACK_S) -> None:
    left: list[str] = []

    async def nothing() -> bool:
        left[:] = await leftovers(fleet.url, ("m", "q", "free"))
        return not left

    try:
        await until(nothing, "Redis to hold nothing", limit_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {left}") from None


async def test_an_account_limit_holds_while_its_replica_is_stopped(stopped: Stopped) -> None:
    """faults-one (max 1) runs a stream on B; B is stopped right after a sweep that kept the
    stream's lease but not its account's entries (not due). Until the lease expires the
    stream runs at the worker and m counts it: A must refuse faults-one a second request
    all along, the last moment before the lease's end included."""
    a, b = stopped.replicas
    lease_key, acct_key = "gw:v2:{m}:leases", account_key("faults-one")
    async with held(b.url, "m", key=KEY_ONE, rid="stopped-one-stream"):
        seen: list[tuple[float | None, float | None]] = []

        async def lease_kept_alone() -> bool:
            seen.append((await score(stopped, lease_key), await score(stopped, acct_key)))
            if len(seen) < 2:
                return False
            (lease_was, entry_was), (lease, entry) = seen[-2:]
            return lease != lease_was and entry == entry_was

        await until(lease_kept_alone, "a sweep keeping the lease alone", 3 * LEASE_TTL_S)
        async with sigstopped(b):
            lease, entry = await score(stopped, lease_key), await score(stopped, acct_key)
            assert lease is not None and lease == seen[-1][0], (lease, seen[-1])
            # The condition under test is time passing: to 300 ms before the lease's end.
            await asyncio.sleep(max(0.0, (lease - await redis_ms(stopped) - 300) / 1000))
            running = worker_load(stopped.worker)["vllm:num_requests_running"]
            answer = await post(a.url, "free", key=KEY_ONE, fail_fast=True)
            left = lease - await redis_ms(stopped)
        print(f"lease {lease}, entry {entry}; A answered {answer.status_code}, {left:.0f} ms left")
        assert left > 0 and running == 1, (left, running)
        assert answer.status_code == 429, (
            f"faults-one (max 1) admitted a second request while its first still ran on the "
            f"stopped replica (lease {lease}, entry {entry}): {answer.text}"
        )
    await clean(stopped)


async def test_a_killed_replicas_account_entry_leaves_with_its_lease(stopped: Stopped) -> None:
    """faults-one (max 1) runs a stream on a third replica, killed -9 right after a sweep
    that kept the stream's lease but not its account's entry (entries are kept a third of
    the TTL apart, so they outlive the leases). A's sweep that reclaims the dead lease takes
    the entry with it: once the lease is gone so is the entry, and A serves faults-one."""
    a, _ = stopped.replicas
    lease_key, acct_key = "gw:v2:{m}:leases", account_key("faults-one")
    doomed = procs.gateway(stopped.tmp, stopped.config)
    flowing = asyncio.Event()

    async def stream() -> None:
        async with held(doomed.url, "m", key=KEY_ONE, rid="killed-one-stream"):
            flowing.set()
            await asyncio.Event().wait()

    running = asyncio.create_task(stream())
    try:
        await asyncio.wait_for(flowing.wait(), 10)
        seen: list[tuple[float | None, float | None]] = []

        async def lease_kept_alone() -> bool:
            seen.append((await score(stopped, lease_key), await score(stopped, acct_key)))
            return len(seen) > 1 and seen[-1][0] != seen[-2][0] and seen[-1][1] == seen[-2][1]

        await until(lease_kept_alone, "a sweep keeping the lease alone", 3 * LEASE_TTL_S)
        doomed.stop(signal.SIGKILL)
        lease, entry = seen[-1]
        assert lease is not None and entry is not None and entry > lease, seen[-1]

        async def reclaimed() -> bool:
            return await score(stopped, lease_key) is None

        await until(reclaimed, "the dead replica's lease reclaimed", LEASE_TTL_S + SLACK_S)
        left = await score(stopped, acct_key)
        answer = await post(a.url, "free", key=KEY_ONE, fail_fast=True)
    finally:
        doomed.stop(signal.SIGKILL)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    print(f"lease {lease}, entry {entry}: entry left {left}; A answered {answer.status_code}")
    assert left is None, f"the account's entry outlived its reclaimed lease: {left}"
    assert answer.status_code == 200, answer.text
    await clean(stopped)


async def test_a_stopped_replicas_waiter_never_runs_over_the_capacity(stopped: Stopped) -> None:
    """q (capacity 1): a stream held on A, then a waiter of faults-two on B, then one of
    faults-one on A. B is stopped; the stream ends, q's slot is granted to B's waiter and
    goes back after the claim time to A's waiter, which runs. B resumes: its waiter must not
    run next to A's (q's worker's own peak stays 1), and is served once A's ends."""
    a, b = stopped.replicas
    flowing, stop = asyncio.Event(), asyncio.Event()

    async def second() -> None:
        async with held(a.url, "q", key=KEY_ONE):
            flowing.set()
            await stop.wait()

    queue = "gw:v2:{q}:queue"
    client = aioredis.from_url(stopped.url)
    late = second_task = None
    try:
        async with held(a.url, "q"):
            late = asyncio.create_task(post(b.url, "q", key=KEY_TWO))
            await until(lambda: _zcard(client, queue, 1), "B's waiter", 5)
            second_task = asyncio.create_task(second())
            await until(lambda: _zcard(client, queue, 2), "A's waiter", 5)
            b.popen.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            started = time.monotonic()
            await asyncio.wait_for(flowing.wait(), CLAIM_S + WAITER_TTL_S + SLACK_S)
            took = time.monotonic() - started
            await asyncio.sleep(0.5)  # the condition under test: B stopped a little longer
        finally:
            b.popen.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        # B's sweeps and its stale wake-up run now; give them a few sweeps.
        await asyncio.sleep(3 * SWEEP_S)
        peak = worker_load(stopped.single)["sim:peak_requests_running"]
        assert peak <= 1, f"q's worker ran {peak} (capacity 1)"
        # Its grant lost, B's waiter is answered as a wait that timed out, or queues on.
        # (Or 503: its calls on their way when it stopped timed out by its clock as it
        # resumed, an outage as it saw it.)
        if late.done():
            answer = late.result()
            code = (answer.status_code, answer.json()["error"]["code"])
            assert code in ((429, "queue_timeout"), (503, "service_unavailable")), code
        stop.set()
        await second_task
        answer = await asyncio.wait_for(late, 20)
        assert answer.status_code in (200, 429, 503), answer.text
        print(f"A's waiter ran {took:.2f}s after B stopped; B's waiter: {answer.status_code}")
    finally:
        stop.set()
        await client.aclose()
        for task in (late, second_task):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
    assert worker_load(stopped.single)["sim:peak_requests_running"] <= 1
    await clean(stopped)


async def _zcard(client: object, key: str, count: int) -> bool:
    return int(await client.zcard(key)) == count  # type: ignore[attr-defined]


ACCOUNTS = (("faults-one", KEY_ONE), ("faults-two", KEY_TWO))
# A stopped replica's account entries live the lease TTL and AccountKeeps.lag_ms (a dead
# one's go with its leases: prelude `drop_entry`).
ENTRIES_S = LEASE_TTL_S + LEASE_TTL_S / 3 + COMMAND_TIMEOUT_S


async def test_account_limits_hold_right_after_redis_restarts_empty(stopped: Stopped) -> None:
    """m (capacity 2) runs faults-two on A and faults-one on B; faults-two and acme wait on
    B and A. Once the entries are old (kept only when due), Redis restarts empty. Once the
    sweeps wrote back what they hold, neither account gets one more request on either
    replica, m is full, the waiters keep their order and are served, nothing is left."""
    a, b = stopped.replicas
    client = aioredis.from_url(stopped.url)
    queue = "gw:v2:{m}:queue"
    waiters: list[asyncio.Task[Any]] = []
    try:
        async with AsyncExitStack() as streams:
            await streams.enter_async_context(held(a.url, "m", key=KEY_TWO))
            await streams.enter_async_context(held(b.url, "m", key=KEY_ONE))
            waiters.append(asyncio.create_task(post(b.url, "m", key=KEY_TWO)))
            await until(lambda: _zcard(client, queue, 1), "the first waiter", 5)
            waiters.append(asyncio.create_task(post(a.url, "m")))
            await until(lambda: _zcard(client, queue, 2), "the second waiter", 5)
            order = await client.zrange(queue, 0, -1)
            seen: list[tuple[list[float], list[float]]] = []

            async def old() -> bool:  # a sweep kept the leases, not the accounts' entries
                leases = cast(
                    ScoredMembers, await client.zrange("gw:v2:{m}:leases", 0, -1, withscores=True)
                )
                acct = cast(
                    ScoredMembers,
                    await client.zrange(account_key("faults-two"), 0, -1, withscores=True),
                )
                seen.append((sorted(s for _, s in leases), sorted(s for _, s in acct)))
                return len(seen) > 1 and seen[-1][0] != seen[-2][0] and seen[-1][1] == seen[-2][1]

            await until(old, "the entries to be old", 3 * LEASE_TTL_S)
            stopped.redis.restart_empty()
            restarted = time.monotonic()
            early: list[int] = []

            async def rebuilt() -> bool:
                # Meanwhile: what the accounts are let in with (within that second).
                for _, key in ACCOUNTS:
                    url = (a, b)[len(early) % 2].url
                    early.append((await post(url, "free", key=key, fail_fast=True)).status_code)
                counts = [await client.zcard(account_key(name)) for name, _ in ACCOUNTS]
                return (
                    await client.zcard("gw:v2:{m}:leases") == 2
                    and await client.zrange(queue, 0, -1) == order
                    and counts == [1, 2]
                )

            took = await until(rebuilt, "the rebuild", SWEEP_S + SLACK_S)
            after: list[httpx.Response] = []
            for url in (a.url, b.url):
                for _, key in ACCOUNTS:
                    after.append(await post(url, "free", key=key, fail_fast=True))
                after.append(await post(url, "m", fail_fast=True))
            codes = [(r.status_code, r.json().get("error", {}).get("code")) for r in after]
            print(f"rebuilt {took:.2f}s after the restart; meanwhile {early}; after {codes}")
            limit, busy = (429, "concurrency_limit"), (429, "model_busy")
            assert codes == [limit, limit, busy] * 2, codes
            assert time.monotonic() - restarted < LEASE_TTL_S  # all of it within the leases
            assert not any(w.done() for w in waiters)
        answers = await asyncio.wait_for(asyncio.gather(*waiters), 20)
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        await client.aclose()
    assert worker_load(stopped.worker)["sim:peak_requests_running"] <= 2
    await clean(stopped, ENTRIES_S + SLACK_S)


async def test_a_killed_replicas_waiters_of_several_accounts_leave_the_queue(
    stopped: Stopped,
) -> None:
    """q (capacity 1) held on A; a third replica queues faults-one, faults-two twice, then
    B queues acme behind them; the third is killed -9 and A's stream ends (its slot goes to
    a dead waiter). B's waiter is served within the claim time and the waiter TTL, q never
    runs two, and the accounts' entries of the dead go too."""
    a, b = stopped.replicas
    client = aioredis.from_url(stopped.url)
    queue = "gw:v2:{q}:queue"
    doomed = procs.gateway(stopped.tmp, stopped.config)
    dead: list[asyncio.Task[Any]] = []
    live: asyncio.Task[httpx.Response] | None = None
    try:
        async with held(a.url, "q"):
            for n, key in enumerate((KEY_ONE, KEY_TWO, KEY_TWO), start=1):
                dead.append(asyncio.create_task(post(doomed.url, "q", key=key)))
                await until(partial(_zcard, client, queue, n), "the doomed waiters", 5)
            live = asyncio.create_task(post(b.url, "q"))
            await until(lambda: _zcard(client, queue, 4), "the live waiter", 5)
            doomed.stop(signal.SIGKILL)
            await asyncio.gather(*dead, return_exceptions=True)
        started = time.monotonic()
        served = await asyncio.wait_for(live, CLAIM_S + WAITER_TTL_S + SLACK_S)
        took = time.monotonic() - started
        assert served.status_code == 200, served.text
        print(f"B's waiter served {took:.2f}s after the slot freed")
    finally:
        doomed.stop(signal.SIGKILL)
        if live is not None:
            await asyncio.gather(live, return_exceptions=True)
        await client.aclose()
    assert worker_load(stopped.single)["sim:peak_requests_running"] <= 1
    await clean(stopped, ENTRIES_S + SLACK_S)
