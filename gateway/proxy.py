"""POST /v1/completions and /v1/chat/completions: the walk of one request (DESIGN.md).

auth -> body -> tier -> fallback plan -> endpoint -> forward -> relay. Each step is a call
into gateway/, tiers/ or routing/; this module only composes them and owns the ASGI I/O.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from gateway.auth import Account, key_from_headers
from gateway.edge import (
    ClientGone,
    Receive,
    RequestHeaders,
    Scope,
    Send,
    dumps,
    parse_body,
    read_body,
    read_headers,
    request_id,
    send_error,
    send_json,
)
from gateway.errors import GatewayError, UpstreamBroken
from gateway.relay import StreamRewriter, Usage, error_event, rewrite_answer, worker_error
from gateway.state import GatewayState
from routing.endpoints import Endpoint
from routing.plan import Candidate, plan_candidates
from routing.upstream import UpstreamResponse
from tiers.policy import Tier
from tiers.resolve import applied_tier, requested_tier

# Fields only the gateway understands: consumed here, never sent to a worker.
GATEWAY_ONLY = ("models", "fail_fast", "service_tier")
# vLLM schedules lower `priority` values first.
WORKER_PRIORITY = {Tier.PRIORITY: -1, Tier.DEFAULT: 0, Tier.FLEX: 1}
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


@dataclass(slots=True)
class Job:
    """One admitted request on its way to one endpoint."""

    rid: str
    account: Account
    candidate: Candidate
    tier: Tier
    endpoint: Endpoint
    stream: bool
    include_usage: bool
    body: bytes
    started: float
    usage: Usage
    status: int = 200
    finished: bool = False
    first_byte: float | None = None


class Proxy:
    """The plain ASGI app behind one completion route."""

    def __init__(self, state: GatewayState, path: str, schema: type[BaseModel]) -> None:
        self._state = state
        self._path = path
        self._schema = schema

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        headers = read_headers(scope)
        rid = request_id(headers.request_id)
        try:
            job = await self._accept(receive, headers, rid, started)
        except ClientGone:
            return
        except GatewayError as exc:
            self._state.metrics.requests.labels("", "", str(exc.status)).inc()
            await send_error(send, exc, rid)
            return
        await self._serve_watched(job, receive, send)

    async def _accept(
        self, receive: Receive, headers: RequestHeaders, rid: str, started: float
    ) -> Job:
        state = self._state
        key = key_from_headers(headers.authorization, headers.x_api_key, headers.xi_api_key)
        account = await state.keys.authenticate(key)
        body = await read_body(receive, headers.content_length, state.config.limits.max_body_bytes)
        payload, request = parse_body(body, self._schema)
        wanted = requested_tier(getattr(request, "service_tier", None), headers.service_tier)
        candidates = plan_candidates(
            getattr(request, "model"),  # noqa: B009 - both schemas have it; keeps this generic
            getattr(request, "models", None),
            fail_fast=bool(getattr(request, "fail_fast", False)),
            registry=state.registry,
            allowed=account.models,
        )
        # Admission over Redis (leases, queue, 429) picks among candidates; until it exists
        # every model has room, so the first known entry serves.
        candidate = candidates[0]
        tier = applied_tier(wanted, candidate.model.tiers, account.tiers)
        endpoint = state.pools.for_model(candidate.model.name).pick()
        stream = bool(getattr(request, "stream", False))
        options = getattr(request, "stream_options", None)
        include_usage = True if options is None else bool(options.include_usage)
        forward = _forward_body(
            payload, endpoint, stream, tier, candidate.model.config.worker_priority
        )
        return Job(
            rid,
            account,
            candidate,
            tier,
            endpoint,
            stream,
            include_usage,
            forward,
            started,
            Usage(),
        )

    async def _serve_watched(self, job: Job, receive: Receive, send: Send) -> None:
        """Serve the job, cancelling it at once if the caller disconnects meanwhile."""
        task = asyncio.current_task()
        assert task is not None
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not job.finished:
                gone.set()
                task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self._serve(job, send)
        except asyncio.CancelledError:
            if not gone.is_set():
                raise
            task.uncancel()
            job.status = 499  # nginx's "client closed request", for metrics only
        finally:
            watcher.cancel()
            self._observe(job)

    async def _serve(self, job: Job, send: Send) -> None:
        endpoint = job.endpoint
        endpoint.inflight += 1
        try:
            try:
                resp = await self._state.upstream.post(
                    endpoint.url + self._path, job.body, _worker_headers(endpoint, job.rid)
                )
            except GatewayError as exc:
                await self._fail(job, send, exc)
                return
            try:
                if resp.status != 200:
                    await self._fail(job, send, worker_error(resp.status, await resp.read()))
                elif job.stream:
                    await self._relay_stream(job, resp, send)
                else:
                    await self._relay_answer(job, resp, send)
            finally:
                resp.close()
        finally:
            endpoint.inflight -= 1

    async def _fail(self, job: Job, send: Send, exc: GatewayError) -> None:
        job.status = exc.status
        job.finished = True
        kind = type(exc).__name__
        self._state.metrics.upstream_errors.labels(
            job.candidate.model.name, job.endpoint.url, kind
        ).inc()
        await send_error(send, exc, job.rid)

    async def _relay_answer(self, job: Job, resp: UpstreamResponse, send: Send) -> None:
        try:
            body = rewrite_answer(await resp.read(), job.candidate.model.name, job.tier, job.usage)
        except GatewayError as exc:
            await self._fail(job, send, exc)
            return
        job.finished = True
        await send_json(send, 200, body, [(b"x-request-id", job.rid.encode("latin-1"))])

    async def _relay_stream(self, job: Job, resp: UpstreamResponse, send: Send) -> None:
        rewriter = StreamRewriter(job.candidate.model.name, job.tier, job.include_usage, job.usage)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*_SSE_HEADERS, (b"x-request-id", job.rid.encode("latin-1"))],
            }
        )
        failure: GatewayError | None = None
        try:
            async for chunk in resp.chunks():
                out = rewriter.feed(chunk)
                if out:
                    if job.first_byte is None:
                        job.first_byte = time.perf_counter()
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if rewriter.done or rewriter.error is not None:
                    break
        except GatewayError as exc:
            failure = exc
        if rewriter.error is None and not rewriter.done:
            failure = failure or UpstreamBroken("The worker's stream ended before [DONE].")
            await send(
                {"type": "http.response.body", "body": error_event(failure), "more_body": True}
            )
        if rewriter.error is not None or failure is not None:
            job.status = 502
        job.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _observe(self, job: Job) -> None:
        metrics = self._state.metrics
        model, tier = job.candidate.model.name, job.tier.value
        metrics.requests.labels(model, tier, str(job.status)).inc()
        metrics.duration.labels(model, tier).observe(time.perf_counter() - job.started)
        if job.first_byte is not None:
            metrics.ttft.labels(model, tier).observe(job.first_byte - job.started)
        if job.usage.reported:
            metrics.tokens.labels(model, tier, "prompt").inc(job.usage.prompt_tokens)
            metrics.tokens.labels(model, tier, "completion").inc(job.usage.completion_tokens)


def _forward_body(
    payload: dict[str, Any], endpoint: Endpoint, stream: bool, tier: Tier, worker_priority: bool
) -> bytes:
    """The caller's body as the worker should see it: unknown fields untouched."""
    forward = {k: v for k, v in payload.items() if k not in GATEWAY_ONLY}
    forward["model"] = endpoint.upstream_model
    if stream:
        # Billing needs the worker's usage even when the caller does not want to see it.
        options = forward.get("stream_options")
        forward["stream_options"] = {
            **(options if isinstance(options, dict) else {}),
            "include_usage": True,
        }
    if worker_priority:
        forward["priority"] = WORKER_PRIORITY[tier]
    return dumps(forward)


def _worker_headers(endpoint: Endpoint, rid: str) -> dict[str, str]:
    headers = {"content-type": "application/json", "x-request-id": rid}
    if endpoint.config.api_key:
        headers["authorization"] = f"Bearer {endpoint.config.api_key}"
    return headers
