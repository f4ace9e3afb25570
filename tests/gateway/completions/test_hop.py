"""The hop to a worker when the lease's endpoint is not one this replica knows (a rolling
config update): the request moves to an endpoint it knows, or gets a 503, never a 500."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import fakeredis
import orjson
import pytest

from gateway.completions.apis import ROUTES
from gateway.completions.exchange import Exchange, Usage
from gateway.completions.hop import Hop
from gateway.completions.streamusage import StreamUsage
from gateway.edge.asgi import Message, Reply
from gateway.runtime.settings import parse_config
from gateway.runtime.state import GatewayState
from routing.admission.admit import Admitted
from routing.admission.plan import plan_candidates
from routing.errors import WorkerBrokeOff, WorkerFailed, WorkerTimeout

KNOWN = ("http://known-1:8000", "http://known-2:8000")
ELSEWHERE = "http://only-in-another-replicas-config:8000"
CONFIG = f"""
redis: {{url: "memory://"}}
models:
  m1:
    endpoints:
      - {{url: "{KNOWN[0]}", max_concurrency: 1}}
      - {{url: "{KNOWN[1]}", max_concurrency: 1}}
"""
ANSWER = b'{"id": "x", "model": "w", "choices": [{"text": "hi"}]}'


class Answer:
    status = 200
    headers: dict[str, str] = {}

    async def read(self) -> bytes:
        return ANSWER

    async def chunks(self) -> AsyncIterator[bytes]:
        yield ANSWER

    def close(self) -> None:
        pass


class Recording:
    def __init__(self) -> None:
        self.urls: list[str] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Answer:
        self.urls.append(url)
        return Answer()


@pytest.fixture
def state() -> GatewayState:
    return GatewayState(
        parse_config(CONFIG, "forward.yaml"),
        redis=fakeredis.FakeAsyncRedis(),
        upstream=Recording(),  # type: ignore[arg-type]
    )


async def admit(state: GatewayState, on: str | None = None) -> Admitted:
    """A lease; with `on`, granted on that endpoint as another replica's config would."""
    slots = state.admission.slots["m1"]

    async def index() -> None:  # Redis's endpoint index follows, as the gateway writes it
        if (call := slots.index()) is not None:
            await state.admission.scripts.call(state.admission.store, call)

    if on is not None:
        slots.set_endpoints([(on, 10, 0.0)])
        await index()
    try:
        candidates = plan_candidates(
            "m1", None, fail_fast=True, registry=state.registry, allowed=None
        )
        return await state.admission.admit(candidates, "acct", 10)
    finally:
        slots.set_endpoints([(url, 1, 0.0) for url in KNOWN])  # this replica's own view
        await index()


async def hop(state: GatewayState, admitted: Admitted) -> tuple[Exchange, list[Message]]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    exchange = Exchange("rid-1", time.perf_counter(), False, StreamUsage(), Usage())
    await Hop(state, exchange, admitted, ROUTES[0], {}, Reply(send)).run()
    return exchange, sent


async def test_a_lease_on_an_unknown_endpoint_moves_to_a_known_one(
    state: GatewayState,
) -> None:
    admitted = await admit(state, on=ELSEWHERE)
    assert admitted.lease.endpoint == ELSEWHERE
    exchange, sent = await hop(state, admitted)
    assert exchange.status == 200
    assert sent[0]["status"] == 200
    assert admitted.lease.endpoint in KNOWN
    upstream = state.upstream
    assert isinstance(upstream, Recording)
    assert upstream.urls == [admitted.lease.endpoint + "/v1/completions"]
    slots = state.admission.slots["m1"]
    redis = state.redis
    member = f"{admitted.lease.id} {admitted.lease.endpoint}"  # the lease names where it is
    assert await redis.zscore(slots.keys[0], member) is not None
    assert int(await redis.hget(slots.keys[3], ELSEWHERE) or 0) == 0  # its load went back
    await state.admission.release(admitted.lease)


async def test_a_lease_on_an_unknown_endpoint_with_no_room_elsewhere_is_a_503(
    state: GatewayState,
) -> None:
    holders = [await admit(state) for _ in KNOWN]  # every known endpoint full
    assert {h.lease.endpoint for h in holders} == set(KNOWN)
    admitted = await admit(state, on=ELSEWHERE)
    exchange, sent = await hop(state, admitted)
    assert exchange.status == 503 and exchange.finished
    assert sent[0]["status"] == 503
    error = orjson.loads(sent[1]["body"])["error"]
    assert error["code"] == "service_unavailable" and "'m1'" in error["message"]
    upstream = state.upstream
    assert isinstance(upstream, Recording) and upstream.urls == []
    for lease in (admitted.lease, *(h.lease for h in holders)):
        await state.admission.release(lease)
    assert await state.redis.zcard(state.admission.slots["m1"].keys[0]) == 0


async def test_a_lease_on_an_unknown_endpoint_never_moves_to_another_unknown_one(
    state: GatewayState,
) -> None:
    """Another replica's config has two endpoints this one does not know, and its view
    stands in Redis's index: a lease granted on one of them moves to an endpoint this
    replica knows, never to the other unknown one (the least loaded of all: a 503 though
    a known endpoint had room)."""
    other = "http://also-only-in-another-replicas-config:8000"
    slots = state.admission.slots["m1"]

    async def index(view: list[tuple[str, int, float]]) -> None:
        slots.set_endpoints(view)
        if (call := slots.index()) is not None:
            await state.admission.scripts.call(state.admission.store, call)

    await index([(ELSEWHERE, 10, 0.0), (other, 10, 0.0), *((url, 10, 0.0) for url in KNOWN)])
    candidates = plan_candidates("m1", None, fail_fast=True, registry=state.registry, allowed=None)
    held = [await state.admission.admit(candidates, "acct", 10) for _ in range(4)]
    # One lease on each (the least loaded in turn); then `other` is the least loaded.
    assert {h.lease.endpoint for h in held} == {ELSEWHERE, other, *KNOWN}
    slots.set_endpoints([(url, 1, 0.0) for url in KNOWN])  # this replica's own view
    on_elsewhere = next(h for h in held if h.lease.endpoint == ELSEWHERE)
    await state.admission.release(next(h.lease for h in held if h.lease.endpoint == other))
    exchange, sent = await hop(state, on_elsewhere)
    assert exchange.status == 200 and sent[0]["status"] == 200
    assert on_elsewhere.lease.endpoint in KNOWN
    for h in held:
        await state.admission.release(h.lease)


class BrokenRefusal(Answer):
    """A worker's error answer whose body cannot be read."""

    def __init__(self, failure: Exception) -> None:
        self.status = 400
        self._failure = failure

    async def read(self) -> bytes:
        raise self._failure


@pytest.mark.parametrize(
    ("failure", "status"),
    [
        (WorkerTimeout("The worker stopped answering."), 504),
        (WorkerBrokeOff("The worker's answer broke off."), 502),
        (WorkerFailed("The worker's answer is too large."), 502),
    ],
)
async def test_an_error_answer_whose_body_fails_is_a_502_or_504_never_a_500(
    state: GatewayState, monkeypatch: pytest.MonkeyPatch, failure: Exception, status: int
) -> None:
    upstream = state.upstream
    assert isinstance(upstream, Recording)

    async def refusing(url: str, body: bytes, headers: dict[str, str]) -> Answer:
        return BrokenRefusal(failure)

    monkeypatch.setattr(upstream, "post", refusing)
    admitted = await admit(state)
    exchange, sent = await hop(state, admitted)
    assert (exchange.status, sent[0]["status"]) == (status, status)
    assert orjson.loads(sent[1]["body"])["error"]["message"] == str(failure)
    await state.admission.release(admitted.lease)
