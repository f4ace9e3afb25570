"""Preemption of flex under faults (docs/api.md, preemption of flex; docs/architecture.md,
"Deadlines and preemption"), on a private redis-server that the tests kill and restart:
two gateway replicas, one simulated worker of one slot whose answers begin only after 2 s.

Waits on other processes are bounded polls (there is no event to wait on across
processes); the bounds are the guarantees under test plus slack.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis.asyncio as aioredis

from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.e2e.test_faults import SLACK_S, get, leftovers, until, worker_load
from tests.redis_server import RedisServer

KEY = "sk-preempt-faults"
LEASE_TTL_S = 10  # longer than any stall here: no lease expires while Redis is stopped
COMMAND_TIMEOUT_S = 0.5
TTFT_MS = 2000
TOKENS = 30
ITL_MS = 100  # a flex stream runs about 3 s once it has begun
RUN = uuid.uuid4().hex[:8]
# How long a release may take to reach Redis on a busy machine: below the sweep's cleanup of
# `pre` (two lease TTLs), so a mark that goes within it went with the release.
RELEASED_S = 3 * SLACK_S


@dataclass
class Fleet:
    redis: RedisServer
    replicas: list[procs.Proc]
    worker: procs.Proc


def config_text(redis_url: str, worker: procs.Proc) -> str:
    return f"""
redis: {{url: "{redis_url}", lease_ttl_s: {LEASE_TTL_S}, command_timeout_s: {COMMAND_TIMEOUT_S}}}
tiers:
  flex: {{max_utilization: 1.0, queue_timeout_s: 30, on_preempt: reject}}
  priority: {{queue_timeout_s: 30}}
keys:
  - {{sha256: "{digest(KEY)}", account: preempt-faults}}
models:
  p:
    tiers: [default, priority, flex]
    endpoints: [{{url: "{worker.url}", max_concurrency: 1, model: m1}}]
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("preempt-faults")
    # Its state survives a restart (an append-only file), as a production Redis's does.
    server = RedisServer(tmp, persistent=True).start()
    started: list[procs.Proc] = []
    try:
        # The worker takes more than the gateway gives it (max-seqs 4 > 1).
        worker = procs.sim(tmp, "--max-seqs", "4", "--ttft-ms", str(TTFT_MS),
                           "--itl-ms", str(ITL_MS), "--tokens", str(TOKENS))  # fmt: skip
        started.append(worker)
        text = config_text(server.url, worker)
        started += [procs.gateway(tmp, text) for _ in range(2)]
        yield Fleet(server, started[1:], worker)
    finally:
        for proc in started:
            proc.stop()
        server.stop()


def headers(rid: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", "x-request-id": rid}


async def zcard(fleet: Fleet, key: str) -> int:
    client = aioredis.Redis.from_url(fleet.redis.url)
    try:
        return int(await client.zcard(key))
    finally:
        await client.aclose()


async def flex_stream(url: str, rid: str, begun: asyncio.Event) -> bytes:
    """A flex stream read to its end; `begun` is set when its answer's head has come."""
    payload = {"model": "p", "prompt": "x", "stream": True, "service_tier": "flex"}
    async with (
        httpx.AsyncClient(base_url=url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=payload, headers=headers(rid)) as answer,
    ):
        begun.set()
        body = await answer.aread()
        assert answer.status_code == 200, body
        return body


async def priority(url: str, rid: str) -> httpx.Response:
    payload = {"model": "p", "prompt": "x", "max_tokens": 2, "service_tier": "priority"}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await client.post("/v1/completions", json=payload, headers=headers(rid))


async def fault(fleet: Fleet, kind: str | None) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        await client.post(fleet.worker.url + "/sim/fault", json={"fault": kind})


async def _ready(url: str) -> bool:
    return (await get(url + "/readyz")).status_code == 200


async def test_a_stream_begun_while_redis_was_down_is_never_cut_by_a_later_preemption(
    fleet: Fleet,
) -> None:
    """A flex request's check before its first byte meets a Redis that is down (killed, to
    restart with its append-only file): it begins its answer, as it should (nobody can
    have chosen it where nothing answers). Once Redis is back, a priority request comes:
    the flex stream has begun, so it must run to its [DONE], uncut, and the priority
    request is served after it; nothing is left in Redis."""
    a, b = (r.url for r in fleet.replicas)
    begun = asyncio.Event()
    flex = asyncio.ensure_future(flex_stream(a, f"pf-{RUN}-flex", begun))
    # Granted, its worker not answering yet (TTFT 2 s): Redis is down until its answer has
    # begun (its check before the first byte could not be sent, so it went on).
    await until(lambda: _pre(fleet), "the flex lease to be preemptible", SLACK_S)
    fleet.redis.kill()
    try:
        await asyncio.wait_for(begun.wait(), TTFT_MS / 1000 + SLACK_S)
    finally:
        fleet.redis.start()  # with what its append-only file kept
    await until(lambda: _ready(a), "replica a to see Redis again", SLACK_S)
    await until(lambda: _ready(b), "replica b to see Redis again", SLACK_S)
    await until(lambda: _subscribed(fleet), "both replicas to listen again", SLACK_S)
    assert not flex.done()
    urgent = asyncio.ensure_future(priority(b, f"pf-{RUN}-vip"))
    body = await flex
    answer = await urgent
    assert answer.status_code == 200, answer.text
    assert body.rstrip().endswith(b"data: [DONE]"), body[-300:]
    assert b'"error"' not in body, body[-300:]
    load = worker_load(fleet.worker)
    assert load["sim:peak_requests_running"] <= 1, load
    await until(lambda: _clean(fleet), "Redis to hold nothing", SLACK_S + 2)


async def _pre(fleet: Fleet) -> bool:
    return await zcard(fleet, "gw:v2:{p}:pre") == 1


async def _subscribed(fleet: Fleet) -> bool:
    client = aioredis.Redis.from_url(fleet.redis.url)
    try:
        return dict(await client.pubsub_numsub("gw:v2:{p}:wake")).get(b"gw:v2:{p}:wake") == 2
    finally:
        await client.aclose()


async def _clean(fleet: Fleet) -> bool:
    left = await leftovers(fleet.redis.url, ("p",))
    doomed = await zcard(fleet, "gw:v2:{p}:doomed") + await zcard(fleet, "gw:v2:{p}:pre")
    return not left and not doomed


async def test_a_flex_request_that_ends_before_its_first_byte_leaves_no_mark(
    fleet: Fleet,
) -> None:
    """A flex lease is offered to preemption (`pre`) until its request starts; one that
    ends before that (its worker failed, its caller hung up during the TTFT) must not stay
    offered: its release takes it off, as it does its slot (the sweep's cleanup after two
    lease TTLs is only for holders that died, and stops altogether once a reload leaves no
    tier that may preempt)."""
    a = fleet.replicas[0].url
    await fault(fleet, "error500")
    try:
        failed = await asyncio.wait_for(flex_stream(a, f"pf-{RUN}-500", asyncio.Event()), 30)
    except AssertionError:
        failed = b"refused"
    finally:
        await fault(fleet, None)
    assert failed == b"refused"
    # Bounded well below the sweep's cleanup (two lease TTLs): only the release can do it.
    await until(lambda: _clean(fleet), "the failed request's marks to go", RELEASED_S)
    gone = asyncio.ensure_future(flex_stream(a, f"pf-{RUN}-gone", asyncio.Event()))
    await until(lambda: _pre(fleet), "the flex lease to be preemptible", SLACK_S)
    gone.cancel()  # the caller hangs up during its TTFT
    with contextlib.suppress(asyncio.CancelledError):
        await gone
    await until(lambda: _clean(fleet), "the hung-up request's marks to go", RELEASED_S)


async def test_the_slot_of_a_doomed_lease_whose_replica_died_goes_to_the_newcomer(
    fleet: Fleet,
) -> None:
    """The replica holding a flex lease not begun is killed -9; a priority request then
    chooses that lease (nobody is left to give it back): it is served once the lease is
    reclaimed at its expiry, and neither `doomed` nor `pre` keeps anything after."""
    a, b = fleet.replicas
    flex = asyncio.ensure_future(flex_stream(a.url, f"pf-{RUN}-dead", asyncio.Event()))
    try:
        await until(lambda: _pre(fleet), "the flex lease to be preemptible", SLACK_S)
        a.stop(signal.SIGKILL)
        with contextlib.suppress(httpx.HTTPError):
            await flex
        answer = await priority(b.url, f"pf-{RUN}-vip-dead")
        assert answer.status_code == 200, answer.text
        assert worker_load(fleet.worker)["sim:peak_requests_running"] <= 1
        await until(lambda: _clean(fleet), "Redis to hold nothing", LEASE_TTL_S + SLACK_S)
    finally:
        flex.cancel()
        a.start()
