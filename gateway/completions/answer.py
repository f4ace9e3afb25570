"""The answer rewriting: worker answers on their way back to the caller, never buffered when
streamed.

The caller sees the gateway's model name and the applied `service_tier`; everything else the
worker sent passes through. Usage is picked up on the way for billing and metrics. Worker
errors become the OpenAI envelope. A streamed answer is held back only until its current
SSE event is complete, and never more than `limits.max_event_bytes` of it (docs/api.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import orjson

from gateway.completions.exchange import Usage
from gateway.completions.streamusage import StreamUsage, UsageShaper
from gateway.errors import (
    GatewayError,
    RateLimited,
    UpstreamFailed,
    UpstreamTimeout,
    WorkerRejected,
)
from routing.errors import LimitReason

MAX_ERROR_MESSAGE = 1000
DONE_EVENT = b"data: [DONE]\n\n"
MAX_EVENT_BYTES = 1024 * 1024  # the default of limits.max_event_bytes
# A partial event may already hold the start of its delimiter ("\n", or "\n\r" when the
# worker ends lines with CRLF): an event of exactly the limit still fits.
_DELIMITER_SLACK = 2


def worker_error(status: int, body: bytes) -> GatewayError:
    """A worker's error answer as the gateway's own error (one meaning per status)."""
    message, code, param = _error_fields(body)
    if status in (408, 504):
        return UpstreamTimeout(f"The worker timed out: {message}")
    if status == 429:
        return RateLimited(
            f"The worker is overloaded: {message}", code=LimitReason.MODEL_BUSY, retry_after_s=1
        )
    if status in (401, 403, 404):
        # The caller's key is not what the worker judged; this is the fleet's misconfiguration.
        return UpstreamFailed(f"The worker refused the gateway ({status}): {message}")
    if 400 <= status < 500:
        return WorkerRejected(status, message, code=code, param=param)
    return UpstreamFailed(f"The worker failed ({status}): {message}")


def _error_fields(body: bytes) -> tuple[str, str | None, str | None]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        text = body[:MAX_ERROR_MESSAGE].decode("utf-8", "replace").strip()
        return text or "no details", None, None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        data = data["error"]
    if not isinstance(data, dict):
        return str(data)[:MAX_ERROR_MESSAGE], None, None
    message = data.get("message", data.get("detail", "no details"))
    if not isinstance(message, str):
        message = orjson.dumps(message).decode()
    code = data.get("code")
    param = data.get("param")
    return (
        message[:MAX_ERROR_MESSAGE],
        str(code) if code is not None and not isinstance(code, int) else None,
        param if isinstance(param, str) else None,
    )


def error_event(exc: GatewayError) -> bytes:
    """A mid-stream error as the OpenAI SDK understands it (the 200 is already out)."""
    return b"data: " + orjson.dumps(exc.envelope()) + b"\n\n"


def rewrite_answer(body: bytes, model: str, tier: str, usage: Usage) -> bytes:
    """A non-streamed worker answer with the gateway's model name and applied tier."""
    dumps: Callable[[Any], bytes] = orjson.dumps
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "surrogate" not in exc.msg:
            raise UpstreamFailed("The worker answered with invalid JSON.") from exc
        # A lone UTF-16 surrogate escape ("\ud800") is valid JSON that orjson refuses: the
        # answer passes as a stream's event would, the escape kept as the worker wrote it.
        data, dumps = _stdlib_loads(body), _stdlib_dumps
    if not isinstance(data, dict):
        raise UpstreamFailed("The worker answered with an unexpected JSON value.")
    data["model"] = model
    data["service_tier"] = tier
    usage.take(data.get("usage"))
    return dumps(data)


def _stdlib_loads(body: bytes) -> Any:
    try:
        return json.loads(body.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError alike
        raise UpstreamFailed("The worker answered with invalid JSON.") from exc


def _stdlib_dumps(data: Any) -> bytes:
    # ensure_ascii: a lone surrogate goes out as its escape (it has no UTF-8 encoding).
    return json.dumps(data, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class StreamRewriter:
    """Splits worker SSE bytes into events and rewrites each `data:` payload.

    Feed it chunks as they arrive; it returns the complete events ready to send (possibly
    empty), keeping any partial event for the next chunk. An event larger than
    `max_event_bytes` (complete, or still partial) ends the stream: what came before it is
    returned, then an SSE error event; `error` is set and the buffer dropped.
    """

    __slots__ = (
        "_buffer", "_cut", "_max_event", "_model", "_model_field", "_shaper", "_tier",
        "_tier_prefix", "done", "error", "usage",
    )  # fmt: skip

    def __init__(
        self,
        model: str,
        tier: str,
        wanted: StreamUsage,
        usage: Usage,
        *,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        self._model = model
        self._tier = tier
        self._shaper = UsageShaper(wanted)
        self._max_event = max_event_bytes
        self._buffer = b""
        self._cut: GatewayError | None = None
        self._model_field = b'"model":' + orjson.dumps(model)
        self._tier_prefix = b'data: {"service_tier":' + orjson.dumps(tier) + b","
        self.usage = usage
        self.done = False
        self.error: GatewayError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held back: the partial event waiting for its end."""
        return len(self._buffer)

    def feed(self, chunk: bytes) -> bytes:
        """The complete events in `chunk` (with what was left over before), rewritten; an
        SSE error event last when an oversized event cut the stream."""
        out = b"".join([self.rewrite(e) for e in self.split(chunk)])
        cut = self._cut
        if cut is not None and self.error is None and not self.done:
            self.error = cut
            out += self._shaper.end(done=False) + error_event(cut)
        return out

    def end(self) -> bytes:
        """What is still held for the caller when the worker's stream ends without
        `[DONE]` (a held finish chunk, gateway/completions/streamusage.py)."""
        return b"" if self.done else self._shaper.end(done=False)

    def split(self, chunk: bytes) -> list[bytes]:
        """The complete events so far, not yet rewritten; a partial one waits for more.
        Past an oversized event nothing more is returned (see `feed`)."""
        if self._cut is not None:
            return []
        data = self._buffer + chunk if self._buffer else chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        *events, self._buffer = data.split(b"\n\n")
        if len(data) > self._max_event:  # one len() per chunk on the common path
            events = self._bounded(events)
        return [e for e in events if e]

    def _bounded(self, events: list[bytes]) -> list[bytes]:
        """The events before the first one over the limit. Past it the stream is cut and the
        buffer dropped: a worker never makes the gateway hold more than one event."""
        limit = self._max_event
        keep = next((i for i, e in enumerate(events) if len(e) > limit), None)
        if keep is None:
            if len(self._buffer) <= limit + _DELIMITER_SLACK:
                return events
            keep = len(events)
        self._buffer = b""
        self._cut = UpstreamFailed(f"The worker sent an SSE event larger than {limit} bytes.")
        return events[:keep]

    def rewrite(self, event: bytes) -> bytes:
        """One event as the caller should see it (b"" when it is dropped)."""
        if not event.startswith(b"data:"):
            return event + b"\n\n"  # comments / keep-alives pass through untouched
        payload = event[5:].strip()
        shaper = self._shaper
        if payload == b"[DONE]":
            self.done = True
            return shaper.end(done=True) + DONE_EVENT
        fast = self._splice(payload)
        if fast is not None:
            if b'"choices":[]' not in payload:
                self.usage.streamed += 1
            return shaper.release() + fast
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return shaper.release() + event + b"\n\n"
        if not isinstance(data, dict):
            return shaper.release() + event + b"\n\n"
        if "error" in data or data.get("object") == "error":
            self.error = worker_error(500, payload)
            return shaper.end(done=False) + error_event(self.error)
        data["model"] = self._model
        data["service_tier"] = self._tier
        if data.get("choices"):
            self.usage.streamed += 1
        usage = data.get("usage")
        if usage is not None:
            self.usage.take(usage)
        return shaper.shape(data)

    def _splice(self, payload: bytes) -> bytes | None:
        """The common token chunk rewritten without parsing it: its `"model"` value swapped
        and `"service_tier"` put first. None when the chunk needs a real look (usage, an
        error, a tier already there, an unexpected shape)."""
        if not payload.startswith(b"{") or b'"error"' in payload or b'"service_tier"' in payload:
            return None
        if not self._shaper.may_pass(payload):
            return None
        # Inside JSON strings every quote is escaped, so this matches only a real key; the
        # first one is the top-level "model" of OpenAI/vLLM chunks (before "choices").
        found = _MODEL_KEY.search(payload)
        if found is None:
            return None
        return b"".join(
            (self._tier_prefix, payload[1 : found.start()], self._model_field,
             payload[found.end() :], b"\n\n")
        )  # fmt: skip


_MODEL_KEY = re.compile(rb'"model"\s*:\s*"[^"\\]*"')
