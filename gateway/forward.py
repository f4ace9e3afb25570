"""The hop to the worker and the relay of its answer (JSON or SSE) back to the caller."""

from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.edge import ClientGone, Send, send_error, send_json
from gateway.errors import GatewayError, UpstreamBroken
from gateway.relay import StreamRewriter, Usage, error_event, rewrite_answer, worker_error
from gateway.state import GatewayState
from routing.admission import Admitted
from routing.endpoints import Endpoint
from routing.upstream import UpstreamResponse

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


@dataclass(slots=True)
class Exchange:
    """What happened to one admitted request, for metrics and (later) its usage record."""

    rid: str
    started: float
    stream: bool
    # Whether the caller sees the usage chunk (the worker is always asked for it).
    include_usage: bool
    usage: Usage
    status: int = 200
    # Set before the last byte goes out: a disconnect after that is not a cancellation.
    finished: bool = False
    first_byte: float | None = None


async def forward(
    state: GatewayState,
    exchange: Exchange,
    admitted: Admitted,
    endpoint: Endpoint,
    path: str,
    body: bytes,
    send: Send,
) -> None:
    endpoint.inflight += 1
    try:
        try:
            resp = await state.upstream.post(
                endpoint.url + path, body, _worker_headers(endpoint, exchange.rid)
            )
        except GatewayError as exc:
            await _fail(state, exchange, admitted, endpoint, send, exc)
            return
        try:
            if resp.status != 200:
                error = worker_error(resp.status, await resp.read())
                await _fail(state, exchange, admitted, endpoint, send, error)
            elif exchange.stream:
                await _relay_stream(state, exchange, admitted, endpoint, resp, send)
            else:
                await _relay_answer(state, exchange, admitted, endpoint, resp, send)
        finally:
            resp.close()
    finally:
        endpoint.inflight -= 1


async def _fail(
    state: GatewayState,
    exchange: Exchange,
    admitted: Admitted,
    endpoint: Endpoint,
    send: Send,
    exc: GatewayError,
) -> None:
    exchange.status = exc.status
    exchange.finished = True
    model = admitted.candidate.model.name
    state.metrics.upstream_errors.labels(model, endpoint.url, type(exc).__name__).inc()
    await send_error(send, exc, exchange.rid)


async def _relay_answer(
    state: GatewayState,
    exchange: Exchange,
    admitted: Admitted,
    endpoint: Endpoint,
    resp: UpstreamResponse,
    send: Send,
) -> None:
    model, tier = admitted.candidate.model.name, admitted.tier.value
    try:
        body = rewrite_answer(await resp.read(), model, tier, exchange.usage)
    except GatewayError as exc:
        await _fail(state, exchange, admitted, endpoint, send, exc)
        return
    exchange.finished = True
    await send_json(send, 200, body, [(b"x-request-id", exchange.rid.encode("latin-1"))])


async def _relay_stream(
    state: GatewayState,
    exchange: Exchange,
    admitted: Admitted,
    endpoint: Endpoint,
    resp: UpstreamResponse,
    send: Send,
) -> None:
    model, tier = admitted.candidate.model.name, admitted.tier.value
    rewriter = StreamRewriter(model, tier, exchange.include_usage, exchange.usage)
    chunks = aiter(resp.chunks())
    # The 200 goes out with the first event (one write, not two), and a worker that fails
    # before its first byte still gets a plain HTTP error, not an SSE one.
    try:
        first = await anext(chunks, b"")
    except GatewayError as exc:
        await _fail(state, exchange, admitted, endpoint, send, exc)
        return
    rid = exchange.rid.encode("latin-1")
    start = {
        "type": "http.response.start",
        "status": 200,
        "headers": [*_SSE_HEADERS, (b"x-request-id", rid)],
    }
    await send(start)
    failure: GatewayError | None = None
    try:
        events = rewriter.split(first)
        while True:
            out = b"".join([rewriter.rewrite(e) for e in events])
            if out:
                if exchange.first_byte is None:
                    exchange.first_byte = time.perf_counter()
                await send({"type": "http.response.body", "body": out, "more_body": True})
            if rewriter.done or rewriter.error is not None:
                break
            chunk = await anext(chunks, None)
            if chunk is None:
                break
            events = rewriter.split(chunk)
    except GatewayError as exc:
        failure = exc
    except OSError as exc:  # the server could not write to the caller: it is gone
        raise ClientGone() from exc
    if rewriter.error is None and not rewriter.done:
        failure = failure or UpstreamBroken("The worker's stream ended before [DONE].")
        await send({"type": "http.response.body", "body": error_event(failure), "more_body": True})
    if rewriter.error is not None or failure is not None:
        exchange.status = 502
    exchange.finished = True
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _worker_headers(endpoint: Endpoint, rid: str) -> dict[str, str]:
    headers = {"content-type": "application/json", "x-request-id": rid}
    if endpoint.config.api_key:
        headers["authorization"] = f"Bearer {endpoint.config.api_key}"
    return headers
