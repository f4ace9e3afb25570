"""The hop to the worker: the body it gets, the call, one reroute when the worker cannot be reached,
and its answer (JSON or SSE, rewritten by gateway/completions/answer.py) sent to the caller."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from gateway.completions.answer import StreamRewriter, error_event, rewrite_answer, worker_error
from gateway.completions.apis import Route
from gateway.completions.exchange import Exchange
from gateway.completions.preempt import preempted
from gateway.edge.asgi import ClientGone, Reply, send_error, send_json
from gateway.edge.body import dumps
from gateway.errors import (
    GatewayError,
    ServiceUnavailable,
    UpstreamBroken,
    UpstreamUnavailable,
    from_routing,
)
from gateway.runtime.state import GatewayState
from routing.admission.admit import Admitted
from routing.errors import RoutingError, UnavailableReason, WorkerUnreachable
from routing.hop.client import HopResponse
from routing.hop.endpoints import Endpoint

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class Hop:
    """One admitted request's trip to a worker and back.

    A worker that cannot be reached before any byte went to the caller is taken out of
    rotation and the request moves, once, to another endpoint of the same model. So does a
    lease on an endpoint this replica does not know (during a rolling config update another
    replica's config may grant one); with nowhere to go, that request gets a 503.
    """

    def __init__(
        self,
        state: GatewayState,
        exchange: Exchange,
        admitted: Admitted,
        route: Route,
        payload: Mapping[str, Any],
        send: Reply,
    ) -> None:
        self._state = state
        self._exchange = exchange
        self._admitted = admitted
        self._route = route
        self._payload = payload
        self._send = send
        # Known once `run` found it (looked up then, not before: a reload may come between).
        self.endpoint: Endpoint | None = None

    async def run(self) -> None:
        try:
            self.endpoint = await self._find_endpoint()
            resp = await self._open(self.endpoint)
        except (GatewayError, RoutingError) as exc:
            await self._fail(_answer(exc))
            return
        endpoint = self.endpoint
        endpoint.inflight += 1
        try:
            self._state.health.answered(endpoint.url, resp.status)
            if resp.status != 200:
                await self._fail(await _worker_refusal(resp))
            elif self._exchange.stream:
                await self._relay_stream(resp)
            else:
                await self._relay_answer(resp)
        finally:
            endpoint.inflight -= 1
            resp.close()

    async def _find_endpoint(self) -> Endpoint:
        """The lease's endpoint as this replica knows it (retired ones included)."""
        lease, pools = self._admitted.lease, self._state.pools
        if lease.local:
            health = self._state.health
            endpoint = pools.pick(lease.model, health.penalty, health.is_up)
            if endpoint is not None:
                self._state.admission.place(lease, endpoint.url)
        else:
            endpoint = pools.find(lease.model, lease.endpoint)
            if endpoint is None and await self._reroute(lease.endpoint):
                endpoint = pools.find(lease.model, lease.endpoint)
        if endpoint is None:
            raise ServiceUnavailable(
                f"No endpoint of {lease.model!r} known to this gateway has room (its config "
                "is changing); retry shortly.",
                reason=UnavailableReason.NO_KNOWN_ENDPOINT,
            )
        return endpoint

    async def _open(self, endpoint: Endpoint) -> HopResponse:
        try:
            return await self._post(endpoint)
        except WorkerUnreachable:
            self._state.health.unreachable(endpoint.url)
            lease = self._admitted.lease
            if lease.local or not await self._reroute(endpoint.url):
                raise
            self._count_error(UpstreamUnavailable.__name__)
            moved = self._state.pools.find(lease.model, lease.endpoint)
            if moved is None:
                raise
            self.endpoint = endpoint = moved
        try:
            return await self._post(endpoint)
        except WorkerUnreachable:
            self._state.health.unreachable(endpoint.url)
            raise

    async def _reroute(self, avoid: str) -> bool:
        """Move the lease off `avoid` onto the least loaded endpoint with room among those
        this replica knows: the index may hold another replica's view (a rolling update),
        whose endpoints this one cannot send to."""
        lease = self._admitted.lease
        pool = self._state.pools.for_model(lease.model)
        known = [e.url for e in pool.endpoints] if pool is not None else []
        return await self._state.admission.reroute(lease, avoid, known, tier=self._admitted.tier)

    async def _post(self, endpoint: Endpoint) -> HopResponse:
        headers = _worker_headers(endpoint, self._exchange)
        url = endpoint.url + self._route.path
        body = worker_body(self._payload, self._exchange.stream, self._admitted, endpoint)
        return await self._state.upstream.post(url, body, headers)

    async def _first_byte(self) -> None:
        """A request that may be preempted asks, before anything goes to its caller,
        whether its slot is still its own; from then on it never is preempted. Raises
        `Preempted` (it sends nothing) when the slot was taken first."""
        admitted, admission = self._admitted, self._state.admission
        if admitted.preemptible and not await admission.preemptions.started(admitted.lease):
            raise preempted(admission, admitted)

    async def _fail(self, exc: GatewayError) -> None:
        self._exchange.status = exc.status
        self._exchange.finished = True
        self._count_error(type(exc).__name__)
        await send_error(self._send, exc, self._exchange.rid, self._exchange.headers)

    def _count_error(self, kind: str) -> None:
        model = self._admitted.candidate.model.name
        url = self.endpoint.url if self.endpoint is not None else self._admitted.lease.endpoint
        self._state.metrics.upstream_errors.labels(model, url, kind).inc()

    async def _relay_answer(self, resp: HopResponse) -> None:
        admitted, exchange = self._admitted, self._exchange
        model, tier = admitted.candidate.model.name, admitted.tier.value
        try:
            body = rewrite_answer(await resp.read(), model, tier, exchange.usage)
        except (GatewayError, RoutingError) as exc:
            await self._fail(_answer(exc))
            return
        await self._first_byte()
        exchange.finished = True
        exchange.first_byte = time.perf_counter()
        rid = exchange.rid.encode("latin-1")
        await send_json(self._send, 200, body, [(b"x-request-id", rid), *exchange.headers])

    async def _relay_stream(self, resp: HopResponse) -> None:
        admitted, exchange, send = self._admitted, self._exchange, self._send
        model, tier = admitted.candidate.model.name, admitted.tier.value
        limit = self._state.config.limits.max_event_bytes
        kind = self._route.stream or StreamRewriter  # a worker that streams unasked
        rewriter = kind(model, tier, exchange.wanted_usage, exchange.usage, max_event_bytes=limit)
        chunks = aiter(resp.chunks())
        # The 200 goes out with the first event (one write, not two), and a worker that
        # fails before its first byte still gets a plain HTTP error, not an SSE one.
        try:
            first = await anext(chunks, b"")
        except (GatewayError, RoutingError) as exc:
            await self._fail(_answer(exc))
            return
        rid = exchange.rid.encode("latin-1")
        headers = [*_SSE_HEADERS, (b"x-request-id", rid), *exchange.headers]
        failure: GatewayError | None = None
        try:
            out = rewriter.feed(first)
        except (GatewayError, RoutingError) as exc:
            out, failure = b"", _answer(exc)
        await self._first_byte()
        if out:
            exchange.first_byte = time.perf_counter()
        try:
            # The head and the first event in one write (gateway/edge/protocol.py).
            await send.start_stream(200, headers, out)
            if failure is None:
                await self._relay_rest(rewriter, chunks)
        except (GatewayError, RoutingError) as exc:
            failure = _answer(exc)
        except OSError as exc:  # the server could not write to the caller: it is gone
            raise ClientGone() from exc
        await self._end_stream(rewriter, failure)

    async def _relay_rest(self, rewriter: StreamRewriter, chunks: AsyncIterator[bytes]) -> None:
        """The events after the first, each sent as it is complete, until the worker's
        stream or the rewriter ends."""
        exchange, send = self._exchange, self._send
        while not rewriter.done and rewriter.error is None:
            chunk = await anext(chunks, None)
            if chunk is None:
                break
            out = rewriter.feed(chunk)
            if out:
                if exchange.first_byte is None:
                    exchange.first_byte = time.perf_counter()
                await send({"type": "http.response.body", "body": out, "more_body": True})

    async def _end_stream(self, rewriter: StreamRewriter, failure: GatewayError | None) -> None:
        """A stream without [DONE] ends with an SSE error event (the 200 is already out);
        the rewriter has sent one already for a worker's error or an oversized event."""
        exchange, send = self._exchange, self._send
        if rewriter.error is None and not rewriter.done:
            failure = failure or UpstreamBroken("The worker's stream ended before [DONE].")
            event = rewriter.end() + error_event(failure)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        if rewriter.error is not None or failure is not None:
            exchange.status = 502
            self._count_error(type(failure or rewriter.error).__name__)
        exchange.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# The gateway's own body fields: consumed, never forwarded.
GATEWAY_ONLY = ("models", "fail_fast", "service_tier")


def worker_body(
    payload: Mapping[str, Any], stream: bool, admitted: Admitted, endpoint: Endpoint
) -> bytes:
    """The caller's body as this endpoint's worker should see it: unknown fields untouched,
    `model` the name it serves, usage always asked for in a stream, and the tier as vLLM's
    `priority` for models that schedule by it."""
    forward = {k: v for k, v in payload.items() if k not in GATEWAY_ONLY}
    forward["model"] = endpoint.upstream_model
    if stream:
        # Billing needs the worker's usage even when the caller does not want to see it.
        options = forward.get("stream_options")
        given = options if isinstance(options, dict) else {}
        forward["stream_options"] = {**given, "include_usage": True}
    if admitted.candidate.model.config.worker_priority:
        forward["priority"] = admitted.tier.worker_priority
    return dumps(forward)


async def _worker_refusal(resp: HopResponse) -> GatewayError:
    """The worker's own error answer, passed on; if its body cannot be read (too large,
    broke off, stalled), that failure instead: a 502 or 504, never a 500."""
    try:
        return worker_error(resp.status, await resp.read())
    except RoutingError as exc:
        return _answer(exc)


def _answer(exc: GatewayError | RoutingError) -> GatewayError:
    """The caller's answer to a failure of the hop: the worker's errors (routing/hop/upstream.py)
    are translated here, at the boundary; the gateway's own pass as they are."""
    return exc if isinstance(exc, GatewayError) else from_routing(exc)


def _worker_headers(endpoint: Endpoint, exchange: Exchange) -> dict[str, str]:
    """The worker sees the id the caller gets back (vLLM takes it as its request id) and
    the caller's trace context: one id and one trace from client to GPU."""
    headers = {"content-type": "application/json", "x-request-id": exchange.rid}
    headers.update(exchange.trace)
    if endpoint.config.api_key:
        headers["authorization"] = f"Bearer {endpoint.config.api_key}"
    return headers
