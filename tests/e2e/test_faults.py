"""docs/architecture.md, "What each fault does", done for real: a private redis-server is restarted
empty, stalled with SIGSTOP, killed; a gateway replica is killed -9 with waiters queued.
The invariants are read from the workers' own counters and from Redis itself. The tests
marked BOTH run again on a 3-master Redis Cluster, where the master of m is the one
restarted or stalled.

Long requests are streams the test holds open and closes itself. Waits on other processes
are bounded polls (there is no event to wait on across processes); the bounds are the
guarantees under test (a sweep, a command timeout, a claim or waiter TTL) plus slack.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol, cast

import httpx
import pytest
import redis.asyncio as aioredis

from routing.store.connect import connect
from routing.store.keys import account_key
from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.redis_cluster import RedisCluster, start_cluster
from tests.redis_server import RedisServer, ScoredMembers, StreamEntries, endpoint_load

KEY = "sk-faults-acme"
KEY_ONE = "sk-faults-one"  # one request in flight at most
KEY_TWO = "sk-faults-two"  # two
# The three keys' part of a fault fleet's config (the tests' replicas and their accounts).
KEYS_YAML = f"""keys:
  - {{sha256: "{digest(KEY)}", account: faults-acme}}
  - {{sha256: "{digest(KEY_ONE)}", account: faults-one, max_concurrency: 1}}
  - {{sha256: "{digest(KEY_TWO)}", account: faults-two, max_concurrency: 2}}
"""
LEASE_TTL_S = 3
COMMAND_TIMEOUT_S = 0.5
SWEEP_S = min(1.0, LEASE_TTL_S / 4)
WAITER_TTL_S = max(3.0, 3 * SWEEP_S)
CLAIM_S = max(3.0, 2 * SWEEP_S + 2 * COMMAND_TIMEOUT_S)  # slots.py Timing.of
SLACK_S = 3.0  # a busy 2-core CI machine
M_BUDGET = 1_000_000  # m's endpoints' token budgets: never binding, always counted


@dataclass
class Fleet:
    redis: RedisServer  # the single Redis, or the Cluster master that serves model m
    url: str  # the store the gateways are given, and the test reads
    replicas: list[procs.Proc]
    workers: list[procs.Proc]  # m: two endpoints of 4
    single: procs.Proc  # q: one endpoint of 1
    config: str
    tmp: Path
    cluster: RedisCluster | None = None


def fleet_config(redis_url: str, workers: list[procs.Proc], single: procs.Proc) -> str:
    return f"""
redis: {{url: "{redis_url}", lease_ttl_s: {LEASE_TTL_S}, command_timeout_s: {COMMAND_TIMEOUT_S}}}
tiers:
  default: {{queue_timeout_s: 30}}
  priority: {{queue_timeout_s: 30}}
models:
  m:
    tiers: [default, priority]
    # Every request of m reserves tokens too (budgets far above what 4 requests need):
    # each fault must give them back as it gives back the slots (issue 28).
    endpoints:
      - {{url: "{workers[0].url}", max_concurrency: 4, model: m1, max_tokens_in_flight: {M_BUDGET}}}
      - {{url: "{workers[1].url}", max_concurrency: 4, model: m1, max_tokens_in_flight: {M_BUDGET}}}
  q:
    endpoints: [{{url: "{single.url}", max_concurrency: 1, model: m1}}]
  free:
    endpoints: [{{url: "{workers[0].url}", max_concurrency: 100, model: m1}}]
{KEYS_YAML}"""


def long_sim(tmp: Path, max_seqs: int) -> procs.Proc:
    # Streams of ~40 s that the tests cut short themselves.
    return procs.sim(
        tmp, "--max-seqs", str(max_seqs), "--ttft-ms", "0", "--itl-ms", "10", "--tokens", "4000"
    )


# A test marked BOTH runs on a single Redis and on a 3-master Redis Cluster of its own (its
# master of m is restarted and stalled), m, free and the usage stream on three masters.
BOTH = pytest.mark.parametrize("fleet", ["single", "cluster"], indirect=True)
SINGLE = pytest.mark.parametrize("fleet", ["single"], indirect=True)


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("faults")
    with fault_store(tmp, request.param) as (server, url, cluster):
        yield from _fleet(tmp, server, url, cluster)


@contextmanager
def fault_store(tmp: Path, kind: str) -> Iterator[tuple[RedisServer, str, RedisCluster | None]]:
    """A single Redis, or a Cluster and its master of m. The Cluster's nodes never give up
    on a stalled one (node timeout 60 s): a stall stays a stall, never a failover."""
    if kind == "single":
        server = RedisServer(tmp).start()
        try:
            yield server, server.url, None
        finally:
            server.stop()
        return
    cluster = start_cluster(tmp / "cluster", ["--cluster-node-timeout", "60000"])
    try:
        nodes = {n: cluster.node_of("{" + n + "}").port for n in ("m", "free", "usage")}
        assert len(set(nodes.values())) == 3, nodes
        assert cluster.node_of("{faults-two}").port != cluster.node_of("{q}").port
        yield cluster.node_of("{m}"), cluster.url, cluster
    finally:
        cluster.stop()


def _fleet(
    tmp: Path, server: RedisServer, url: str, cluster: RedisCluster | None
) -> Iterator[Fleet]:
    started: list[procs.Proc] = []
    try:
        # The workers take more than the gateway gives them (max-seqs 8 > 4): if the
        # gateway over-admits, their own counters show it.
        workers = [long_sim(tmp, 8), long_sim(tmp, 8)]
        single = long_sim(tmp, 4)
        started += [*workers, single]
        config = fleet_config(url, workers, single)
        replicas = [procs.gateway(tmp, config) for _ in range(2)]
        started += replicas
        yield Fleet(server, url, replicas, workers, single, config, tmp, cluster)
    finally:
        for proc in started:
            proc.stop()


# --- helpers ---------------------------------------------------------------------------------


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Refused(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status


RUN = uuid.uuid4().hex[:8]
_ids = itertools.count()


def rid(test: str) -> str:
    """A request id unique to this run and test: its usage record is found by it."""
    return f"faults-{RUN}-{test}-{next(_ids)}"


@asynccontextmanager
async def held(
    url: str, model: str, key: str = KEY, rid: str | None = None, **extra: Any
) -> AsyncIterator[None]:
    """A long stream, admitted and flowing until the block ends (then the slot frees)."""
    headers = {**auth(key), **({"x-request-id": rid} if rid else {})}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        payload = {"model": model, "prompt": "x", "stream": True, **extra}
        async with client.stream("POST", "/v1/completions", json=payload, headers=headers) as r:
            if r.status_code != 200:
                raise Refused(r.status_code, (await r.aread()).decode())
            chunks = r.aiter_bytes()  # keep a reference: a collected iterator closes the stream
            await anext(chunks)
            yield


async def post(
    url: str, model: str, key: str = KEY, rid: str | None = None, **extra: Any
) -> httpx.Response:
    payload = {"model": model, "prompt": "x", "max_tokens": 2, **extra}
    headers = {**auth(key), **({"x-request-id": rid} if rid else {})}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await client.post("/v1/completions", json=payload, headers=headers)


async def assert_records(fleet: Fleet | LocalFleet, prefix: str, admitted: set[str]) -> None:
    """Exactly one usage record per admitted request, in this fleet's Redis; none for a
    request that was refused."""
    found: Counter[str] = Counter()

    async def complete() -> bool:
        found.clear()
        async with redis_of(fleet) as client:
            for _, fields in cast(StreamEntries, await client.xrange("usage")):
                request = fields[b"request_id"].decode()
                if request.startswith(prefix):
                    found[request] += 1
        return set(found) >= admitted

    try:
        await until(complete, "the usage records", SWEEP_S + SLACK_S)
    finally:
        assert found == Counter(admitted), (found, admitted)


async def get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.get(url)


async def until(check: Callable[[], Awaitable[bool]], what: str, limit_s: float) -> float:
    """Poll `check` until true, at most `limit_s`; the seconds it took."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < limit_s, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


class HasStore(Protocol):
    """A fleet of this module or another: the address of its store."""

    @property
    def url(self) -> str: ...


@asynccontextmanager
async def redis_of(fleet: HasStore) -> AsyncIterator[aioredis.Redis]:
    client = connect(fleet.url, command_timeout_s=5.0)  # a Cluster client on a Cluster
    try:
        yield client
    finally:
        await client.aclose()


async def zcard(fleet: Fleet, key: str) -> int:
    async with redis_of(fleet) as client:
        return int(await client.zcard(key))


async def queue_ids(fleet: Fleet, model: str) -> list[str]:
    async with redis_of(fleet) as client:
        queue = cast(list[bytes], await client.zrange("gw:v2:{" + model + "}:queue", 0, -1))
        return [m.decode() for m in queue]


def worker_load(worker: procs.Proc) -> dict[str, float]:
    """The worker's own counters: now and the most ever (running, waiting)."""
    values: dict[str, float] = {}
    for line in httpx.get(worker.url + "/metrics").text.splitlines():
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "sim:peak_requests_running", "sim:peak_requests_waiting",
                     "sim:peak_tokens_running"):  # fmt: skip
            if line.startswith(name + " ") or line.startswith(name + "{"):
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def assert_never_overloaded(fleet: Fleet) -> None:
    """The gateway gives each worker of `m` at most 4; the workers would take 8."""
    for worker in fleet.workers:
        load = worker_load(worker)
        assert load["sim:peak_requests_running"] <= 4, (worker.url, load)
        assert load["sim:peak_requests_waiting"] == 0, (worker.url, load)


async def assert_clean(fleet: Fleet, limit_s: float = LEASE_TTL_S + SLACK_S) -> None:
    """Nothing held in Redis once everything has ended (bounded: dead holders expire)."""
    left: list[str] = []

    async def clean() -> bool:
        left[:] = await leftovers(fleet.url, ("m", "q", "free"))
        return not left

    try:
        await until(clean, "Redis to hold nothing", limit_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {left}") from None


async def leftovers(url: str, models: tuple[str, ...]) -> list[str]:
    """What Redis still holds for requests: leases, waiters, endpoint loads and reserved
    tokens, account entries."""
    found: list[str] = []
    client = connect(url, command_timeout_s=5.0)
    try:
        for model in models:
            tag = "gw:v2:{" + model + "}:"
            for key in ("leases", "queue", "qexp"):
                if members := await client.zrange(tag + key, 0, -1):
                    found.append(f"{tag}{key}: {members}")
            if held_by := await client.hgetall(tag + "ep_of"):
                found.append(f"{tag}ep_of: {held_by}")
            if endpoint_load(await client.hgetall(tag + "ep_load")):
                found.append(f"{tag}ep_load: {await client.hgetall(tag + 'ep_load')}")
            if any(int(v) for v in (await client.hgetall(tag + "ep_tok")).values()):
                found.append(f"{tag}ep_tok: {await client.hgetall(tag + 'ep_tok')}")
        async for key in client.scan_iter(match="gw:v2:acct:*"):
            if members := await client.zrange(key, 0, -1):
                found.append(f"{key!r}: {members}")
    finally:
        await client.aclose()
    return found


# --- Redis restarted empty ---------------------------------------------------------------------


@BOTH
async def test_redis_restarted_empty_gets_back_what_every_replica_holds(fleet: Fleet) -> None:
    """Item 1: 8 streams hold capacity 8, two waiters queue, one account is at its limit;
    Redis restarts empty. Within a sweep everything is written back: new fail-fast
    requests are refused, the account limit holds, the waiters keep their order."""
    a, b = (r.url for r in fleet.replicas)
    admitted = {rid("restart") for _ in range(10)}
    ids = iter(sorted(admitted))
    async with AsyncExitStack() as streams:
        for i in range(7):
            await streams.enter_async_context(held((a, b)[i % 2], "m", rid=next(ids)))
        await streams.enter_async_context(held(b, "m", key=KEY_ONE, rid=next(ids)))
        first = asyncio.create_task(post(a, "m", rid=next(ids)))
        await until(lambda: _queued(fleet, "m", 1), "the first waiter", 5)
        second = asyncio.create_task(post(b, "m", rid=next(ids)))
        await until(lambda: _queued(fleet, "m", 2), "the second waiter", 5)
        order = await queue_ids(fleet, "m")

        fleet.redis.restart_empty()
        if fleet.cluster is not None:  # a restarted master refuses writes for its first 2 s
            await asyncio.to_thread(fleet.cluster.wait_ok)
        # At once, before any sweep has written anything back: nothing is admitted.
        early = await asyncio.gather(
            *(post((a, b)[i % 2], "m", rid=rid("restart"), fail_fast=True) for i in range(8))
        )
        took = await until(lambda: _rebuilt(fleet, order), "the rebuild", SWEEP_S + SLACK_S)
        busy = await asyncio.gather(
            *(post((a, b)[i % 2], "m", rid=rid("restart"), fail_fast=True) for i in range(8))
        )
        for answers in (early, busy):
            assert [r.status_code for r in answers] == [429] * 8, [r.text for r in answers]
            assert {r.json()["error"]["code"] for r in answers} == {"model_busy"}
        over = await post(a, "free", key=KEY_ONE, rid=rid("restart"))
        assert over.status_code == 429 and over.json()["error"]["code"] == "concurrency_limit"
        assert not first.done() and not second.done()
        await streams.aclose()  # slots free: the waiters go, first come first served
    answers = list(await asyncio.wait_for(asyncio.gather(first, second), 20))
    assert [r.status_code for r in answers] == [200, 200]
    assert_never_overloaded(fleet)
    await assert_clean(fleet)
    await assert_records(fleet, f"faults-{RUN}-restart-", admitted)
    print(f"rebuilt {took:.2f}s after the restart")


async def _queued(fleet: Fleet, model: str, count: int) -> bool:
    return len(await queue_ids(fleet, model)) == count


async def _rebuilt(fleet: Fleet, order: list[str]) -> bool:
    return (
        await zcard(fleet, "gw:v2:{m}:leases") == 8
        and await queue_ids(fleet, "m") == order
        and await zcard(fleet, account_key("faults-one")) == 1
    )


# --- Redis stalled ------------------------------------------------------------------------------


@BOTH
async def test_a_stalled_redis_is_an_outage_not_a_hang(fleet: Fleet) -> None:
    """Item 2: SIGSTOP. Requests are answered 503 within the command timeout plus a sweep,
    /readyz says so, admitted streams go on, and the gateway recovers by itself."""
    a, b = (r.url for r in fleet.replicas)
    stream = rid("stall")
    async with held(a, "m", rid=stream):
        fleet.redis.pause()
        try:
            started = time.monotonic()
            answers = await asyncio.gather(
                post(a, "m", rid=rid("stall")), post(b, "m", rid=rid("stall"), fail_fast=True)
            )
            waited = time.monotonic() - started
            assert [r.status_code for r in answers] == [503, 503]
            assert all("Redis" in r.json()["error"]["message"] for r in answers)
            assert waited < COMMAND_TIMEOUT_S + SWEEP_S + SLACK_S, waited
            ready = await get(a + "/readyz")
            assert ready.status_code == 503 and "redis" in ready.json()["reason"]
        finally:
            fleet.redis.resume()
        await until(lambda: _ok(a, "m"), "admission to come back", SWEEP_S + SLACK_S)
        assert (await get(a + "/readyz")).status_code == 200
    assert_never_overloaded(fleet)
    await assert_clean(fleet)
    await assert_records(fleet, f"faults-{RUN}-stall-", {stream})
    print(f"a request sent during the stall waited {waited:.2f}s")


async def _ok(url: str, model: str) -> bool:
    return (await post(url, model, fail_fast=True)).status_code == 200


# --- account entries of waiters -------------------------------------------------------------


@BOTH
async def test_a_waiters_account_entry_outlives_the_lease_ttl(fleet: Fleet) -> None:
    """Item 4: a request waits in the queue longer than the lease TTL; its entry in the
    account's count stays (its replica keeps it alive), so the limit still holds."""
    a, b = (r.url for r in fleet.replicas)
    async with held(a, "q"):
        waiter = asyncio.create_task(post(b, "q", key=KEY_TWO))
        await until(lambda: _queued(fleet, "q", 1), "the waiter", 5)
        async with redis_of(fleet) as client:
            entry, first_expiry = (
                cast(
                    ScoredMembers,
                    await client.zrange(account_key("faults-two"), 0, -1, withscores=True),
                )
            )[0]

            async def pushed() -> bool:
                score = await client.zscore(account_key("faults-two"), entry)
                return score is not None and score > first_expiry + LEASE_TTL_S * 1000

            # Kept alive past the TTL it was taken with.
            await until(pushed, "the entry to be kept alive", LEASE_TTL_S + SWEEP_S + SLACK_S)
        async with held(a, "free", key=KEY_TWO):  # one waiting + one running = the limit
            over = await post(a, "free", key=KEY_TWO)
            assert over.status_code == 429 and over.json()["error"]["code"] == "concurrency_limit"
        assert not waiter.done()
    assert (await asyncio.wait_for(waiter, 20)).status_code == 200
    await assert_clean(fleet)


# --- a replica dies with waiters ----------------------------------------------------------------


@BOTH
async def test_waiters_of_a_killed_replica_leave_the_queue(fleet: Fleet) -> None:
    """Item 10: a replica killed -9 with three waiters at the head of the queue. A live
    waiter behind them is served once the slot frees: the dead ones leave within the
    waiter TTL, and a slot granted to one of them comes back after the claim time."""
    a, b = (r.url for r in fleet.replicas)
    doomed = procs.gateway(fleet.tmp, fleet.config)
    try:
        async with held(a, "q"):
            dead = [asyncio.create_task(post(doomed.url, "q", rid=rid("dead"))) for _ in range(3)]
            await until(lambda: _queued(fleet, "q", 3), "the doomed replica's waiters", 5)
            live_id = rid("dead")
            live = asyncio.create_task(post(b, "q", rid=live_id))
            await until(lambda: _queued(fleet, "q", 4), "the live waiter", 5)
            doomed.stop(signal.SIGKILL)
            await asyncio.gather(*dead, return_exceptions=True)  # their connections died
            gone = await until(
                lambda: _queued(fleet, "q", 1), "dead waiters to leave", WAITER_TTL_S + SLACK_S
            )
        started = time.monotonic()
        served = await asyncio.wait_for(live, CLAIM_S + WAITER_TTL_S + SLACK_S)
        assert served.status_code == 200
        served_s = time.monotonic() - started
        print(f"dead waiters left in {gone:.2f}s; the live one served {served_s:.2f}s later")
    finally:
        doomed.stop(signal.SIGKILL)
    await assert_clean(fleet)
    await assert_records(fleet, f"faults-{RUN}-dead-", {live_id})


@SINGLE
async def test_a_granted_waiter_keeps_its_slot_past_the_claim_time(fleet: Fleet) -> None:
    """A waiter's grant lasts the claim time until its replica's sweeps keep it, as every
    lease (there is no claim call): a stream granted from the queue and still running well
    past the claim time holds q's one slot all along; a newcomer queued behind it is served
    only once it ends."""
    a, b = (r.url for r in fleet.replicas)
    flowing, stop = asyncio.Event(), asyncio.Event()

    async def granted_stream() -> None:
        async with held(b, "q"):  # queued behind the stream held first
            flowing.set()
            await stop.wait()

    task: asyncio.Task[None] | None = None
    try:
        async with held(a, "q"):  # q's one slot, before the other is sent
            task = asyncio.create_task(granted_stream())
            await until(lambda: _queued(fleet, "q", 1), "the waiter", 5)
        await asyncio.wait_for(flowing.wait(), 10)  # granted on the held stream's end
        newcomer = asyncio.create_task(post(a, "q"))
        await until(lambda: _queued(fleet, "q", 1), "the newcomer", 5)
        # The condition under test is time passing: the claim time, a sweep, slack.
        await asyncio.sleep(CLAIM_S + SWEEP_S + 1.0)
        assert not newcomer.done()  # a grant reclaimed would have let it in
        assert await _queued(fleet, "q", 1)
        stop.set()
        await task
        assert (await asyncio.wait_for(newcomer, 10)).status_code == 200
    finally:
        stop.set()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
    await assert_clean(fleet)


@BOTH
async def test_a_grant_to_a_dead_waiter_goes_back_after_the_claim_time(fleet: Fleet) -> None:
    """Item 10: the slot is granted to a dead replica's waiter before its queue entry
    expires; no sweep of its replica keeps it, so it returns within the claim time and the
    live waiter behind gets it (instead of after the lease TTL)."""
    a, b = (r.url for r in fleet.replicas)
    doomed = procs.gateway(fleet.tmp, fleet.config)
    try:
        async with held(a, "q"):
            dead = asyncio.create_task(post(doomed.url, "q"))
            await until(lambda: _queued(fleet, "q", 1), "the doomed waiter", 5)
            live = asyncio.create_task(post(b, "q"))
            await until(lambda: _queued(fleet, "q", 2), "the live waiter", 5)
            doomed.stop(signal.SIGKILL)
            await asyncio.gather(dead, return_exceptions=True)
        # The held stream ended at once: its slot went to the dead waiter (head of queue).
        served = await asyncio.wait_for(live, CLAIM_S + SWEEP_S + SLACK_S)
        assert served.status_code == 200
    finally:
        doomed.stop(signal.SIGKILL)
    await assert_clean(fleet)


# --- on_outage: local ---------------------------------------------------------------------------


@dataclass
class LocalFleet:
    redis: RedisServer
    replicas: list[procs.Proc]
    worker: procs.Proc

    @property
    def url(self) -> str:
        return self.redis.url


@pytest.fixture(scope="module")
def local_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    tmp = tmp_path_factory.mktemp("local")
    server = RedisServer(tmp).start()
    started: list[procs.Proc] = []
    try:
        worker = long_sim(tmp, 8)  # the gateway gives it 3
        started.append(worker)
        config = f"""
redis: {{url: "{server.url}", lease_ttl_s: {LEASE_TTL_S}, command_timeout_s: {COMMAND_TIMEOUT_S},
        on_outage: local}}
models:
  l: {{endpoints: [{{url: "{worker.url}", max_concurrency: 3, model: m1}}]}}
keys: [{{sha256: "{digest(KEY)}", account: faults-acme}}]
"""
        replicas = [procs.gateway(tmp, config) for _ in range(2)]
        started += replicas
        yield LocalFleet(server, replicas, worker)
    finally:
        for proc in started:
            proc.stop()
        server.stop()


async def test_local_shares_add_up_to_the_capacity(local_fleet: LocalFleet) -> None:
    """Item 12: Redis dies under two `on_outage: local` replicas while one of them runs two
    of the capacity of 3. Those two count against its own limit, the free slot is shared:
    together the replicas run the capacity, not more."""
    a, b = (r.url for r in local_fleet.replicas)
    before = [rid("local"), rid("local")]
    admitted = set(before)
    async with AsyncExitStack() as streams:
        for request in before:
            await streams.enter_async_context(held(a, "l", rid=request))
        for url in (a, b):  # each replica's view is its last sweep's: wait until both saw it
            await until(partial(_sees, url, 2, 2), "both replicas' sweeps", 5)
        local_fleet.redis.kill()
        for i in range(6):
            request = rid("local")
            try:
                await streams.enter_async_context(
                    held((a, b)[i % 2], "l", rid=request, fail_fast=True)
                )
                admitted.add(request)
            except Refused as refused:
                # 429: the replica's limit is reached; 503: its limit is 0.
                assert refused.status in (429, 503), refused
        running = worker_load(local_fleet.worker)["vllm:num_requests_running"]
        assert len(admitted) == 3 and running == 3, (admitted, running)
        local_fleet.redis.start()
    load = worker_load(local_fleet.worker)
    assert load["sim:peak_requests_running"] <= 3 and load["sim:peak_requests_waiting"] == 0
    # Records of the outage waited on disk and reached Redis once it was back.
    await assert_records(local_fleet, f"faults-{RUN}-local-", admitted)


async def _sees(url: str, replicas: int, inflight: int) -> bool:
    text = (await get(url + "/metrics")).text
    return (
        f"gateway_replicas {replicas:.1f}" in text
        and f'gateway_inflight{{model="l"}} {inflight:.1f}' in text
    )


# --- shutdown -----------------------------------------------------------------------------------


@SINGLE
async def test_sigterm_turns_waiters_away_and_tells_those_cut_at_the_grace(fleet: Fleet) -> None:
    """SIGTERM: queued requests get a 503 `shutting_down` at once (their callers can go to
    another replica), running ones get the grace period; those still running when it ends
    are told so (a 503 envelope, or an SSE error event ending the stream), never a bare
    500 or a cut connection, and their records say what the callers got."""
    grace_s = 2
    doomed = procs.gateway(fleet.tmp, fleet.config + f"shutdown_grace_s: {grace_s}\n")
    try:
        stream_id, plain_id, rest, cut = await _sigterm_under_load(fleet, doomed, grace_s)
        assert b'"shutting_down"' in rest and not rest.rstrip().endswith(b"[DONE]")
        assert cut.status_code == 503 and cut.json()["error"]["code"] == "shutting_down"
        assert doomed.popen is not None and doomed.popen.wait(timeout=SLACK_S + grace_s) == 0
    finally:
        doomed.stop(signal.SIGKILL)
    await assert_records(fleet, f"faults-{RUN}-sigterm-", {stream_id, plain_id})
    async with redis_of(fleet) as client:
        stream = cast(StreamEntries, await client.xrange("usage"))
        entries = {f[b"request_id"].decode(): f for _, f in stream}
    for request in (stream_id, plain_id):
        assert (entries[request][b"status"], entries[request][b"outcome"]) == (b"503", b"error")
    await assert_clean(fleet)


@SINGLE
async def test_a_second_signal_cuts_the_requests_short_at_once_and_loses_nothing(
    fleet: Fleet,
) -> None:
    """SIGTERM, then SIGINT: uvicorn's forced stop, no more waiting for the grace. The
    requests in flight are cut short at once as at the grace's end (told `shutting_down`),
    their records are written and their slots released by the gateway itself, not left to
    expire, and its shutdown runs whole: exit code 0 and no traceback in its log."""
    doomed = procs.gateway(fleet.tmp, fleet.config + "shutdown_grace_s: 60\n")
    try:
        async with _loaded(fleet, doomed, "forced", waiters=1) as load:
            assert doomed.popen is not None
            doomed.popen.send_signal(signal.SIGTERM)
            turned_away = await asyncio.wait_for(load.waiters[0], SLACK_S)  # the first is in
            assert turned_away.status_code == 503, turned_away.text
            doomed.popen.send_signal(signal.SIGINT)
            rest = b"".join([load.first] + [c async for c in _within(load.chunks, SLACK_S)])
        stream_id, plain_id, plain = load.stream_id, load.plain_id, load.plain
        cut = await asyncio.wait_for(plain, SLACK_S)
        assert doomed.popen.wait(timeout=SLACK_S) == 0
        # Released by the gateway before it exited: its leases (3 s) have not expired yet.
        assert await leftovers(fleet.url, ("m", "q")) == []
    finally:
        doomed.stop(signal.SIGKILL)
    assert b'"shutting_down"' in rest and not rest.rstrip().endswith(b"[DONE]")
    assert cut.status_code == 503 and cut.json()["error"]["code"] == "shutting_down"
    await assert_records(fleet, f"faults-{RUN}-forced-", {stream_id, plain_id})
    log = doomed.log.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


async def _within(chunks: AsyncIterator[bytes], limit_s: float) -> AsyncIterator[bytes]:
    """The rest of a stream, which must end within `limit_s` in all."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            yield await asyncio.wait_for(anext(chunks), max(0.0, deadline - time.monotonic()))
        except StopAsyncIteration:
            return


async def _sigterm_under_load(
    fleet: Fleet, doomed: procs.Proc, grace_s: float
) -> tuple[str, str, bytes, httpx.Response]:
    """A stream and a plain request running, two waiters queued; SIGTERM. The waiters must
    be turned away at once. Returns the ids, the stream's bytes and the plain answer."""
    async with _loaded(fleet, doomed, "sigterm", waiters=2) as load:
        assert doomed.popen is not None
        doomed.popen.send_signal(signal.SIGTERM)
        started = time.monotonic()
        turned_away = await asyncio.wait_for(asyncio.gather(*load.waiters), grace_s + SLACK_S)
        assert time.monotonic() - started < grace_s  # at once, not at the end of the grace
        for answer in turned_away:
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "shutting_down"
        rest = b"".join([load.first] + [chunk async for chunk in load.chunks])
    return load.stream_id, load.plain_id, rest, await asyncio.wait_for(load.plain, SLACK_S)


@dataclass
class _Load:
    stream_id: str
    plain_id: str
    chunks: AsyncIterator[bytes]  # the rest of the stream
    first: bytes  # what the stream had sent when the load was in place
    plain: asyncio.Task[httpx.Response]
    waiters: list[asyncio.Task[httpx.Response]]


@asynccontextmanager
async def _loaded(
    fleet: Fleet, doomed: procs.Proc, test: str, waiters: int
) -> AsyncIterator[_Load]:
    """On `doomed`: a stream (its first bytes read) and a plain request running, and
    `waiters` requests queued behind them, while the block runs."""
    stream_id, plain_id = rid(test), rid(test)
    headers = {**auth(KEY), "x-request-id": stream_id}
    body = {"model": "q", "prompt": "x", "stream": True}
    async with (
        httpx.AsyncClient(base_url=doomed.url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body, headers=headers) as r,
    ):
        chunks = r.aiter_bytes()
        first = await anext(chunks)
        plain = asyncio.create_task(post(doomed.url, "m", rid=plain_id, max_tokens=4000))
        queued = [
            asyncio.create_task(post(doomed.url, "q", rid=rid(f"{test}-waiter")))
            for _ in range(waiters)
        ]
        await until(lambda: _queued(fleet, "q", waiters), "the waiters", 5)
        await until(lambda: _busy(fleet.workers, 1), "the plain request at its worker", 5)
        yield _Load(stream_id, plain_id, chunks, first, plain, queued)


async def _busy(workers: list[procs.Proc], running: int) -> bool:
    return sum(worker_load(w)["vllm:num_requests_running"] for w in workers) == running
