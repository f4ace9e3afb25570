"""POST /v1/completions and /v1/chat/completions: the walk of one request
(docs/architecture.md).

auth -> body -> tier -> fallback plan -> admission (lease) -> hop -> answer -> release.
Each step is a call into gateway/, tiers/ or routing/; this module composes them and owns
the ASGI I/O.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from gateway.completions.apis import Route
from gateway.completions.billing import usage_fields
from gateway.completions.endings import crashed, cut_short, end_with, shut_down, uncancel
from gateway.completions.exchange import Exchange, Parsed, Usage
from gateway.completions.hop import Hop
from gateway.completions.preempt import requeued, unless_preempted
from gateway.completions.streamusage import StreamUsage
from gateway.completions.trace import trace_headers
from gateway.edge.access import NOTE, AccessNote
from gateway.edge.asgi import (
    ClientGone,
    Receive,
    Reply,
    RequestHeaders,
    Scope,
    Send,
    read_body,
    read_headers,
    request_id,
    send_error,
)
from gateway.edge.body import parse_body
from gateway.edge.deadline import request_deadline
from gateway.edge.encoding import decoded
from gateway.edge.protocol import forget_disconnect, on_disconnect
from gateway.errors import (
    GatewayError,
    RateLimited,
    ServiceUnavailable,
    from_routing,
)
from gateway.ratelimits import Headers, quota_headers
from gateway.runtime.auth import Account, key_from_headers
from gateway.runtime.state import GatewayState
from gateway.schemas.common import GatewayRequest, RoutedRequest
from routing.admission.admit import Admitted
from routing.admission.plan import plan_candidates
from routing.choice.affinity import affinity_key
from routing.errors import Limited, Preempted, RoutingError, UnavailableReason
from routing.quotas import Quotas
from tiers.resolve import requested_tier

log = logging.getLogger("gateway.route")


class CompletionRoute:
    """The plain ASGI app behind one completion route."""

    def __init__(self, state: GatewayState, route: Route) -> None:
        self._state = state
        self._route = route
        self._schema = route.schema

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        headers = read_headers(scope)
        rid = request_id(headers.request_id)
        note: AccessNote | None = scope.get(NOTE)
        if note is not None:
            note.request_id = rid
        reply = Reply(send)
        try:
            await self._serve(receive, reply, headers, rid, started, note)
        except Exception as exc:  # the last resort (house style): it answers, logs and counts
            if await crashed(exc, rid, reply, stream=False):
                self._state.metrics.requests_of("", "", "500").inc()

    async def _serve(
        self,
        receive: Receive,
        reply: Reply,
        headers: RequestHeaders,
        rid: str,
        started: float,
        note: AccessNote | None,
    ) -> None:
        state = self._state
        account: Account | None = None
        try:
            if state.draining:
                raise ServiceUnavailable(
                    "The gateway is shutting down.", reason=UnavailableReason.SHUTTING_DOWN
                )
            key = key_from_headers(headers.authorization, headers.x_api_key, headers.xi_api_key)
            account = await state.keys.authenticate(key)
            payload, request = await self._body(receive, headers)
            deadline_s = request_deadline(headers.request_timeout)
        except ClientGone:
            return
        except GatewayError as exc:
            await self._refused_early(exc, rid, reply, account)
            return
        except asyncio.CancelledError:  # the server's stop cut it short while it was read
            uncancel()
            state.metrics.requests_of("", "", "503").inc()
            await end_with(shut_down(), rid, reply, stream=False)
            return
        wanted = requested_tier(request.service_tier, headers.service_tier)
        parsed = Parsed(
            rid, started, account, payload, request, wanted, headers.source, note, deadline_s
        )  # fmt: skip
        exchange = _exchange(parsed, headers)
        await _until_disconnect(self._handle(parsed, exchange, reply), receive, exchange)

    async def _body(
        self, receive: Receive, headers: RequestHeaders
    ) -> tuple[dict[str, Any], RoutedRequest]:
        """The body as the worker will get it, and its validated view (413, 415, 422)."""
        limit = self._state.config.limits.max_body_bytes
        body = await read_body(receive, headers.content_length, limit)
        payload, request = parse_body(decoded(body, headers.content_encoding, limit), self._schema)
        return request.for_worker(payload), request

    async def _handle(self, parsed: Parsed, exchange: Exchange, reply: Reply) -> None:
        try:
            admitted = await self._admit(parsed)
        except RoutingError as exc:  # translated here, where the answer is decided
            await self._refused(parsed, exchange, reply, exc)
            return
        except asyncio.CancelledError:
            if exchange.caller_gone:
                raise
            await cut_short(parsed.rid, exchange, reply)
            self._state.metrics.requests_of("", "", str(exchange.status)).inc()
            return
        exchange.headers = _admitted_headers(parsed.account, admitted)
        next_try: Admitted | None = admitted
        while next_try is not None:
            next_try = await self._serve_admitted(parsed, exchange, reply, next_try)

    async def _serve_admitted(
        self, parsed: Parsed, exchange: Exchange, reply: Reply, admitted: Admitted
    ) -> Admitted | None:
        """The admitted request's hop and release; a flex request preempted before its
        first byte (gateway/completions/preempt.py) is answered 429 `preempted`, or its
        second admission is returned (`tiers.flex.on_preempt: requeue`)."""
        preempted: Preempted | None = None
        try:
            hop = Hop(self._state, exchange, admitted, self._route, parsed.payload, reply)
            await unless_preempted(hop.run(), self._state.admission, admitted)
        except Preempted as exc:
            preempted, exchange.status, exchange.preempted = exc, 429, True
        except ClientGone:
            exchange.status = 499  # nginx's "client closed request", for metrics only
        except asyncio.CancelledError:
            if exchange.caller_gone:
                exchange.status = 499
                raise
            await cut_short(parsed.rid, exchange, reply)
        except Exception as exc:  # the last resort: answered, logged, and in the record
            if not reply.ended:
                exchange.status = 500  # the record says what the caller got
            exchange.finished = True
            await crashed(exc, parsed.rid, reply, exchange.stream, exchange.headers)
        finally:
            self._release(parsed, admitted, exchange, observe=preempted is None)
        if preempted is None:
            return None
        again = None
        try:
            again = await requeued(self._state, parsed, exchange, admitted)
        finally:  # its answer is counted once: the 429 here, else its second admission's
            if again is None:
                self._observe(admitted, exchange, parsed.note)
        if again is None:
            error = from_routing(preempted)
            model, tier = admitted.candidate.model.name, admitted.tier.value
            self._state.metrics.rejections.labels(model, tier, error.code).inc()
            await send_error(reply, error, parsed.rid, exchange.headers)
        return again

    def _release(
        self, parsed: Parsed, admitted: Admitted, exchange: Exchange, *, observe: bool = True
    ) -> None:
        """The slot back with the usage record (and the rate limits' true-up), in one round
        trip, whatever the record holds; its answer counted (`observe`: not for one
        preempted, which may be queued again and answered later)."""
        admission = self._state.admission
        record: dict[str, str] | None = None
        try:
            record = self._record(parsed, admitted, exchange)
        except Exception as exc:  # the slot must go back whatever the record holds
            admission.ledger.record_lost(parsed.rid, f"not built ({type(exc).__name__})")
        admission.release(admitted.lease, record, admitted.rate, preempted=exchange.preempted)
        if observe:
            self._observe(admitted, exchange, parsed.note)

    async def _admit(self, parsed: Parsed) -> Admitted:
        request, account = parsed.request, parsed.account
        candidates = plan_candidates(
            request.model,
            request.models,
            fail_fast=request.fail_fast,
            registry=self._state.registry,
            allowed=account.models,
            wanted=parsed.wanted,
            allowed_tiers=account.tiers,
            api=self._route.name,
        )
        cache_key = affinity_key(*request.cache_key())
        rates = account.rates
        tokens = parsed.tokens()
        admitted = await self._state.admission.admit(
            candidates, account.name, account.max_concurrency, cache_key, account.weight,
            tokens=tokens, rates=rates, deadline_s=parsed.deadline_s,
        )  # fmt: skip
        if admitted.candidate is not candidates[0]:
            first = candidates[0].model.name
            self._state.metrics.fallbacks.labels(first, admitted.candidate.model.name).inc()
        return admitted

    def _record(self, parsed: Parsed, admitted: Admitted, exchange: Exchange) -> dict[str, str]:
        request = parsed.request
        return usage_fields(
            exchange,
            admitted,
            account=parsed.account.name,
            key_id=parsed.account.key_id,
            requested_model=(request.models or [request.model])[0],
            requested_tier=parsed.wanted.value,
            user=request.end_user(),
            source=parsed.source,
            payload=parsed.payload,
            tiers=self._state.config.tiers,
        )

    async def _refused_early(
        self, exc: GatewayError, rid: str, reply: Reply, account: Account | None
    ) -> None:
        """An answer before admission (a 401, 413, 422, a shutdown's 503)."""
        self._state.metrics.requests_of("", "", str(exc.status)).inc()
        await send_error(reply, exc, rid, await self._quota_headers(account))

    async def _refused(
        self, parsed: Parsed, exchange: Exchange, reply: Reply, exc: RoutingError
    ) -> None:
        """Admission's refusal (a 429, a 503, an unknown model's 404) as the answer."""
        error = from_routing(exc)
        self._rejected(parsed, error)
        if isinstance(exc, Limited) and exc.wait_estimate_s is not None:  # its deadline's
            tier = parsed.wanted.value
            self._state.metrics.wait_estimate.labels(error.model, tier).observe(exc.wait_estimate_s)
        exchange.finished = True
        headers = await self._quota_headers(parsed.account, exc.quotas)
        await send_error(reply, error, parsed.rid, headers)

    async def _quota_headers(
        self, account: Account | None, quotas: Quotas | None = None
    ) -> Headers:
        """A rate-limited key's x-ratelimit-* headers: `quotas` as admission said, else (an
        answer that never reached admission) as Redis says now."""
        if account is None or account.rates is None:
            return ()
        if quotas is None:
            return await self._state.quota_headers(account)
        return quota_headers(quotas)

    def _rejected(self, parsed: Parsed, exc: GatewayError) -> None:
        """Counted under the model the walk stood at (none for an unknown model's 404)."""
        metrics = self._state.metrics
        model = exc.model
        tier = parsed.wanted.value if model else ""
        if isinstance(exc, RateLimited):
            metrics.rejections.labels(model, tier, exc.code).inc()
        metrics.requests_of(model, tier, str(exc.status)).inc()
        if parsed.note is not None:
            parsed.note.model, parsed.note.tier = model or None, tier or None

    def _observe(self, admitted: Admitted, exchange: Exchange, note: AccessNote | None) -> None:
        model, tier = admitted.candidate.model.name, admitted.tier.value
        if (estimate := admitted.wait_estimate_s) is not None:
            metrics = self._state.metrics
            metrics.wait_estimate.labels(model, tier).observe(estimate)
            waited = admitted.lease.queued_ms / 1000
            metrics.wait_estimate_error.labels(model, tier).observe(abs(waited - estimate))
        served = self._state.metrics.served(model, tier)
        ttft = None if exchange.first_byte is None else exchange.first_byte - exchange.started
        served.answered(exchange.status, time.perf_counter() - exchange.started, ttft)
        if note is not None:
            note.model, note.tier, note.status = model, tier, exchange.status
            note.queue_ms = round(admitted.lease.queued_ms, 3)
            note.ttft_ms = None if ttft is None else round(ttft * 1000, 3)
        usage = exchange.usage
        if usage.reported:
            served.tokens(usage.prompt_tokens, usage.completion_tokens)


def _exchange(parsed: Parsed, headers: RequestHeaders) -> Exchange:
    """What will happen to the request once admitted, as it starts."""
    request = parsed.request
    options = request.stream_options if isinstance(request, GatewayRequest) else None
    trace = trace_headers(headers.traceparent, headers.tracestate)
    return Exchange(
        parsed.rid, parsed.started, request.streams(), StreamUsage.of(options), Usage(),
        trace=trace,
    )  # fmt: skip


async def _until_disconnect(
    work: Coroutine[Any, Any, None], receive: Receive, exchange: Exchange
) -> None:
    """Run `work`, cancelling it at once if the caller disconnects before it has finished:
    told by the server protocol (gateway/edge/protocol.py), else by a task waiting on `receive`."""
    task = asyncio.current_task()
    assert task is not None

    def gone() -> None:
        if not exchange.finished:
            exchange.caller_gone = True
            task.cancel()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone()

    told = on_disconnect(receive, gone)
    watcher = None if told else asyncio.get_running_loop().create_task(watch())
    try:
        await work
    except asyncio.CancelledError:
        if not exchange.caller_gone:
            raise
        task.uncancel()
    finally:
        if watcher is None:
            forget_disconnect(receive)
        else:
            watcher.cancel()


def _admitted_headers(account: Account, admitted: Admitted) -> Headers:
    """What every answer of an admitted request carries: its key's x-ratelimit-* headers
    as its charge left them (the limits alone where Redis did not answer)."""
    if account.rates is None:
        return ()
    return quota_headers(admitted.rate.quotas if admitted.rate else account.rates.unknown())
