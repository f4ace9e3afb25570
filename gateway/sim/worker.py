"""`gateway sim`: a simulated vLLM-like GPU worker for demos, tests and benchmarks.

A raw ASGI app (no framework on the hot path, because benchmarks use it with zero delays as a
near-free upstream). It generates for at most `max_seqs` requests at once and queues the rest
in FIFO order, emits the first token after `ttft_ms` and one more every `itl_ms`, and stops at
once when the client goes away, counting the request as aborted so tests can prove that a
gateway cancels its upstream calls. All state lives on the app object.

Test seams: `GET|DELETE /sim/requests` (the last requests received, as forwarded to us),
`GET|POST /sim/fault` (hang, error500, die_mid_stream), and `GET /sim/peak`: the load now,
the peaks since the last read, and the spans of the requests that ended since then (so a
test can prove, from the worker's own view, that it was never given more than its share).
Reading it starts a new window; the all-time peaks in /metrics are not reset.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import (
    CONTENT_TYPE_LATEST,
)
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.sim.load import Slots, Span
from gateway.sim.metrics import SimMetrics
from gateway.sim.responses import (
    EmbeddingsReply,
    ResponsesReply,
    parse_embeddings_job,
    parse_responses_job,
)
from gateway.sim.text import BadRequest, Job, Reply, error_body, make_plan, parse_job
from gateway.sim.wire import (
    Tracked,
    body_chunk,
    finished_unless_gone,
    lifespan,
    read_body,
    response_start,
    send_json,
    wait_disconnect,
)

FAULTS = frozenset({"hang", "error500", "die_mid_stream"})
RECENT_REQUESTS = 100
# Spans of ended requests kept for the next /sim/peak read; older ones are dropped (counted).
SPANS_KEPT = 10_000
_DIE_AFTER_TOKENS = 2

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class SimOptions:
    models: tuple[str, ...] = ("sim-model",)
    max_seqs: int = 8  # at most this many requests generate at once; the rest queue (FIFO)
    ttft_ms: float = 50.0  # delay before the first token
    itl_ms: float = 10.0  # delay between tokens
    tokens: int = 16  # natural answer length in tokens when max_tokens allows
    fault: str | None = None  # one of FAULTS; also settable at run time via POST /sim/fault
    # The KV cache in tokens (None: unbounded, only max_seqs counts), in whole blocks of
    # block_size tokens: what vLLM's `vllm:cache_config_info` reports (num_gpu_blocks).
    kv_tokens: int | None = None
    block_size: int = 16

    @property
    def kv_blocks(self) -> int | None:
        return None if self.kv_tokens is None else self.kv_tokens // self.block_size

    @property
    def kv_budget(self) -> int | None:
        blocks = self.kv_blocks
        return None if blocks is None else blocks * self.block_size


class SimulatedCrash(RuntimeError):
    """Raised mid-stream by the die_mid_stream fault; the server then drops the connection."""


def build_sim_app(options: SimOptions) -> ASGIApp:
    """A fresh simulated worker; each app has its own slots, metrics and request log."""
    return SimApp(options)


class SimApp:
    """The ASGI app behind `build_sim_app`."""

    def __init__(self, options: SimOptions) -> None:
        _check(options)
        self.options = options
        self.fault = options.fault
        self.slots = Slots(options.max_seqs, options.kv_budget)
        self.metrics = SimMetrics(options.models, options.kv_blocks, options.block_size,
                                  self.slots)  # fmt: skip
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)
        # [x-request-id, start, end (time.monotonic of this host), aborted] per ended request.
        self.spans: deque[list[Any]] = deque(maxlen=SPANS_KEPT)
        self.spans_dropped = 0
        self._ttft = options.ttft_ms / 1000.0
        self._itl = options.itl_ms / 1000.0
        self._instant = self._ttft == 0 and self._itl == 0
        self._routes: dict[str, dict[str, Handler]] = {
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions": {"POST": self._chat_completions},
            "/v1/responses": {"POST": self._responses},
            "/v1/embeddings": {"POST": self._embeddings},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/metrics": {"GET": self._metrics},
            "/sim/requests": {"GET": self._recent_requests, "DELETE": self._clear_requests},
            "/sim/fault": {"GET": self._get_fault, "POST": self._set_fault},
            "/sim/peak": {"GET": self._peak},
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        methods = self._routes.get(scope["path"])
        if methods is None:
            await send_json(send, 404, {"detail": "Not Found"})
            return
        handler = methods.get(scope["method"])
        if handler is None:
            await send_json(send, 405, {"detail": "Method Not Allowed"})
            return
        tracked = Tracked(send)
        try:
            await handler(scope, receive, tracked)
        except asyncio.CancelledError:
            # Its server's forced stop (a second signal) cancels a request in flight: it
            # ends as a stopping worker ends it (a 503, or the stream's end), not as an
            # exception uvicorn logs with its traceback.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            await tracked.end()

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, "completions")

    async def _chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, "chat")

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, "responses")

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, "embeddings")

    async def _generate(self, scope: Scope, receive: Receive, send: Send, api: str) -> None:
        raw = await read_body(receive)
        if raw is None:
            return
        body, json_error = _loads(raw)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self.recent.append({"path": scope["path"], "body": body, "headers": headers})
        fault = self.fault
        if fault == "hang":
            await wait_disconnect(receive)
            return
        if fault == "error500":
            message = "Simulated worker failure (fault error500)."
            await send_json(send, 500, error_body(500, "InternalServerError", message))
            return
        job = self._validate(body, json_error, api)
        if isinstance(job, tuple):
            await send_json(send, *job)
            return
        kind, prefix = _REPLIES[api]
        plan = make_plan(job, self.options.tokens)
        reply = kind(job, plan, prefix + uuid.uuid4().hex, int(time.time()))
        if not self.slots.fits_ever(_kv_tokens(reply)):
            message = (
                f"This request needs {_kv_tokens(reply)} tokens of KV cache (its prompt and "
                f"its answer) and the cache holds {self.slots.budget}."
            )
            await send_json(send, 400, error_body(400, "BadRequestError", message))
            return
        span = Span(headers.get("x-request-id", "")[:200], self._ended)
        try:
            reason = await self._answer(reply, receive, send, span, die=fault == "die_mid_stream")
        except SimulatedCrash:
            self.metrics.finished(job.model, "abort")
            raise
        self.metrics.finished(job.model, reason)

    def _validate(self, body: Any, json_error: str, api: str) -> Job | tuple[int, Any]:
        """The job, or the status and vLLM-style error body to answer with."""
        try:
            if json_error:
                raise BadRequest(f"The request body is not valid JSON: {json_error}")
            job = _PARSERS[api](body, self.options.models[0])
        except BadRequest as exc:
            return 400, error_body(400, "BadRequestError", str(exc))
        if job.model not in self.options.models:
            message = f"The model `{job.model}` does not exist."
            return 404, error_body(404, "NotFoundError", message)
        return job

    async def _answer(
        self, reply: Reply, receive: Receive, send: Send, span: Span, die: bool
    ) -> str:
        """Generate under a slot; the finish reason, or "abort" when the client went away."""
        if reply.job.stream:
            # Headers go out before the slot is granted, as with vLLM's streaming responses.
            await send(response_start(200, b"text/event-stream; charset=utf-8"))
        tokens = _kv_tokens(reply)
        if self._instant and self.slots.try_acquire(tokens):
            # Nothing to wait for, so no disconnect watcher: the cheap path for benchmarks.
            with span:
                try:
                    await self._emit(reply, send, die)
                finally:
                    self.slots.release(tokens)
            return reply.plan.finish_reason
        work = asyncio.ensure_future(self._emit_in_slot(reply, send, span, die))
        if await finished_unless_gone(work, receive):
            return reply.plan.finish_reason
        return "abort"

    async def _emit_in_slot(self, reply: Reply, send: Send, span: Span, die: bool) -> None:
        # The span ends the moment the slot (or the place in line) is given up.
        tokens = _kv_tokens(reply)
        with span:
            await self.slots.acquire(tokens)
            try:
                await self._emit(reply, send, die)
            finally:
                self.slots.release(tokens)

    def _ended(self, span: list[Any]) -> None:
        if len(self.spans) == SPANS_KEPT:
            self.spans_dropped += 1
        self.spans.append(span)

    async def _emit(self, reply: Reply, send: Send, die: bool) -> None:
        start = asyncio.get_running_loop().time()
        if not reply.job.stream:
            await self._pace(start, max(reply.plan.length - 1, 0))
            await send_json(send, 200, reply.body())
            return
        await self._pace(start, 0)
        for event in reply.role_events():
            await send(body_chunk(event))
        steps = min(reply.plan.length, _DIE_AFTER_TOKENS) if die else reply.plan.length
        for step in range(steps):
            if step:
                await self._pace(start, step)
            for index in range(reply.plan.choices):
                await send(body_chunk(reply.token_event(index, step)))
        if die:
            raise SimulatedCrash("fault die_mid_stream: dropping the connection mid-stream")
        *events, last = reply.closing_events()
        for event in events:
            await send(body_chunk(event))
        await send({"type": "http.response.body", "body": last, "more_body": False})

    async def _pace(self, start: float, step: int) -> None:
        """Sleep until token `step` is due (drift-free; no sleep at all when it is due)."""
        if self._instant:
            return
        delay = start + self._ttft + step * self._itl - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "vllm", "root": m}
            for m in self.options.models
        ]
        await send_json(send, 200, {"object": "list", "data": data})

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(response_start(200, None, content_length=0))
        await send({"type": "http.response.body", "body": b""})

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.metrics.render()
        await send(response_start(200, CONTENT_TYPE_LATEST.encode(), content_length=len(body)))
        await send({"type": "http.response.body", "body": body})

    async def _recent_requests(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"requests": list(self.recent)})

    async def _clear_requests(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.recent.clear()
        await send_json(send, 200, {"requests": []})

    async def _peak(self, scope: Scope, receive: Receive, send: Send) -> None:
        running, waiting, inflight, tokens = self.slots.take_window()
        spans, dropped = list(self.spans), self.spans_dropped
        self.spans.clear()
        self.spans_dropped = 0
        payload = {
            "running": self.slots.running,
            "waiting": self.slots.waiting,
            "peak_running": running,
            "peak_waiting": waiting,
            "peak_inflight": inflight,
            "tokens": self.slots.tokens,
            "peak_tokens": tokens,
            "kv_budget": self.slots.budget,
            "spans": spans,
            "spans_dropped": dropped,
        }
        await send_json(send, 200, payload)

    async def _get_fault(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"fault": self.fault})

    async def _set_fault(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await read_body(receive)
        if raw is None:
            return
        try:
            fault = orjson.loads(raw)["fault"]
        except (orjson.JSONDecodeError, TypeError, KeyError):
            fault = "<missing>"
        if fault is not None and fault not in FAULTS:
            message = f"`fault` must be null or one of {sorted(FAULTS)}."
            await send_json(send, 400, error_body(400, "BadRequestError", message))
            return
        self.fault = fault
        await send_json(send, 200, {"fault": fault})


# Each API's body reading, and its reply's kind and id prefix (as vLLM's ids).
_PARSERS: dict[str, Callable[[Any, str], Job]] = {
    "completions": lambda body, model: parse_job(body, False, model),
    "chat": lambda body, model: parse_job(body, True, model),
    "responses": parse_responses_job,
    "embeddings": parse_embeddings_job,
}
_REPLIES: dict[str, tuple[type[Reply], str]] = {
    "completions": (Reply, "cmpl-"),
    "chat": (Reply, "chatcmpl-"),
    "responses": (ResponsesReply, "resp_"),
    "embeddings": (EmbeddingsReply, "embd-"),
}


def _loads(raw: bytes) -> tuple[Any, str]:
    """The body's JSON, and why it is not JSON ("" when it is)."""
    try:
        return orjson.loads(raw), ""
    except orjson.JSONDecodeError as exc:
        return None, str(exc)


def _kv_tokens(reply: Reply) -> int:
    """What a request holds of the KV cache by its end: its prompt and its answer."""
    return reply.job.prompt_tokens + reply.plan.completion_tokens


def _check(options: SimOptions) -> None:
    if not options.models:
        raise ValueError("the simulator needs at least one model name")
    if options.max_seqs < 1:
        raise ValueError("max_seqs must be at least 1")
    if options.tokens < 0 or options.ttft_ms < 0 or options.itl_ms < 0:
        raise ValueError("tokens, ttft_ms and itl_ms must not be negative")
    if options.block_size < 1:
        raise ValueError("block_size must be at least 1")
    if options.kv_tokens is not None and options.kv_tokens < options.block_size:
        raise ValueError("kv_tokens must hold at least one block (block_size tokens)")
    if options.fault is not None and options.fault not in FAULTS:
        raise ValueError(f"fault must be one of {sorted(FAULTS)}, not {options.fault!r}")
