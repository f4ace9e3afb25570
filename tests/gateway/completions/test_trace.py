"""Trace context and request id cross the gateway to the worker, checked and bounded: a real
aiohttp worker on a loopback port records the headers the gateway's own upstream sends."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

import fakeredis
import httpx
import orjson
import pytest
from aiohttp import web

from gateway.app.front import GatewayApp, build_app
from gateway.completions.trace import (
    MAX_TRACESTATE,
    trace_headers,
    valid_traceparent,
    valid_tracestate,
)
from gateway.runtime.settings import parse_config
from gateway.runtime.state import GatewayState
from tests.gateway.app.test_app import ANSWER
from tests.redis_server import free_port

KEY = "sk-trace"
PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
STATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"

BAD_PARENTS = [
    "",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # no flags
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # uppercase
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero parent id
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
    PARENT + "-extra",  # version 00 has exactly four fields
    PARENT + " ",
    "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-" + "x" * 300,  # oversize
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\nx-evil: 1",
]


@pytest.mark.parametrize(
    "value", [PARENT, "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09-what-comes"]
)
def test_well_formed_traceparent(value: str) -> None:
    assert valid_traceparent(value)


@pytest.mark.parametrize("value", BAD_PARENTS)
def test_ill_formed_traceparent(value: str) -> None:
    assert not valid_traceparent(value)


@pytest.mark.parametrize(
    "value",
    [STATE, "a=1", "tenant@vendor=v a l", "a=1,,b=2", ",".join(f"k{i}=v" for i in range(32))],
)
def test_well_formed_tracestate(value: str) -> None:
    assert valid_tracestate(value)


@pytest.mark.parametrize(
    "value",
    [
        "Upper=1",  # keys are lowercase
        "a",
        "a=",
        "a=b=c",  # '=' is not a value character
        "a=1\nb=2",
        ",".join(f"k{i}=v" for i in range(33)),  # more than 32 members
        "a=" + "v" * MAX_TRACESTATE,  # longer than forwarded
    ],
)
def test_ill_formed_tracestate(value: str) -> None:
    assert not valid_tracestate(value)


def test_tracestate_goes_only_beside_a_valid_traceparent() -> None:
    assert trace_headers(PARENT, STATE) == {"traceparent": PARENT, "tracestate": STATE}
    assert trace_headers(PARENT, "Bad") == {"traceparent": PARENT}
    assert trace_headers(None, STATE) == {}
    assert trace_headers(BAD_PARENTS[1], STATE) == {}


# --- through the gateway, to a worker that records what it was sent ---------------------------


class Worker:
    """A loopback worker answering every completion, recording each request's headers."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.port = free_port()
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._answer)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _answer(self, request: web.Request) -> web.Response:
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        await request.read()
        return web.Response(body=ANSWER, content_type="application/json")

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    w = Worker()
    await w.start()
    yield w
    await w.stop()


@pytest.fixture
async def gateway(worker: Worker) -> AsyncIterator[GatewayApp]:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    config = f"""
redis: {{url: "memory://"}}
models:
  m1:
    endpoints: [{{url: "http://127.0.0.1:{worker.port}", max_concurrency: 4}}]
keys:
  - {{sha256: "{digest}", account: trace}}
"""
    state = GatewayState(parse_config(config, "trace.yaml"), redis=fakeredis.FakeAsyncRedis())
    await state.upstream.start()  # the real aiohttp hop, without the whole lifespan
    yield build_app(state)
    await state.upstream.close()


async def post(app: GatewayApp, headers: list[tuple[str, str]]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    body = orjson.dumps({"model": "m1", "prompt": "hi"})
    sent: list[tuple[str, str]] = [("authorization", f"Bearer {KEY}"), *headers]
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        response = await client.post("/v1/completions", content=body, headers=sent)
    await app.state.admission.drain()  # the release is done (not: every task of the loop)
    return response


async def test_trace_context_and_request_id_reach_the_worker(
    gateway: GatewayApp, worker: Worker
) -> None:
    sent = [("traceparent", PARENT), ("tracestate", STATE), ("x-request-id", "req-abc-1")]
    resp = await post(gateway, sent)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == "req-abc-1"
    [seen] = worker.seen
    assert (seen["traceparent"], seen["tracestate"]) == (PARENT, STATE)
    assert seen["x-request-id"] == "req-abc-1"
    assert "authorization" not in seen  # the caller's key never goes on


async def test_the_worker_gets_the_new_request_id_the_caller_gets(
    gateway: GatewayApp, worker: Worker
) -> None:
    for supplied in ([], [("x-request-id", "bad\tid")], [("x-request-id", "x" * 129)]):
        resp = await post(gateway, supplied)
        assert resp.status_code == 200
        rid = resp.headers["x-request-id"]
        assert len(rid) == 32 and rid != dict(supplied).get("x-request-id")
        assert worker.seen[-1]["x-request-id"] == rid
        assert "traceparent" not in worker.seen[-1]


@pytest.mark.parametrize("parent", BAD_PARENTS[1:])
async def test_ill_formed_trace_context_is_dropped_not_forwarded(
    gateway: GatewayApp, worker: Worker, parent: str
) -> None:
    resp = await post(gateway, [("traceparent", parent), ("tracestate", STATE)])
    assert resp.status_code == 200
    [seen] = worker.seen
    assert "traceparent" not in seen and "tracestate" not in seen


async def test_repeated_trace_headers(gateway: GatewayApp, worker: Worker) -> None:
    # Repeated tracestate headers are one list; two traceparents are no context at all.
    await post(gateway, [("traceparent", PARENT), ("tracestate", "a=1"), ("tracestate", "b=2")])
    assert worker.seen[-1]["tracestate"] == "a=1,b=2"
    await post(gateway, [("traceparent", PARENT), ("traceparent", PARENT)])
    assert "traceparent" not in worker.seen[-1]


async def test_oversize_tracestate_is_dropped_and_the_traceparent_kept(
    gateway: GatewayApp, worker: Worker
) -> None:
    huge = ",".join(f"k{i}=" + "v" * 20 for i in range(30))
    assert len(huge) > MAX_TRACESTATE
    await post(gateway, [("traceparent", PARENT), ("tracestate", huge)])
    assert worker.seen[-1]["traceparent"] == PARENT
    assert "tracestate" not in worker.seen[-1]
