"""The Responses API's event stream on its way back (vLLM and OpenAI send it alike):
events named on an `event:` line, the response itself inside the lifecycle events
(`response.created`, ... `response.completed`), its usage in the last one, and no
`[DONE]`: the stream ends with its terminal event."""

from __future__ import annotations

import orjson

from gateway.completions.answer import StreamRewriter, error_event, worker_error

# The events that end a response (the stream's end follows them).
TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete"})
_TEXT_DELTA = b'"response.output_text.delta"'


class ResponsesRewriter(StreamRewriter):
    """A Responses stream: the response's `model` and `service_tier` set as the gateway
    serves it, its usage read for billing; the other events pass untouched, unparsed."""

    __slots__ = ()

    def rewrite(self, event: bytes) -> bytes:
        at = event.find(b"data:")
        if at < 0 or (at > 0 and event[at - 1] != 0x0A):  # no data line: a comment
            return event + b"\n\n"
        head, payload = event[:at], event[at + 5 :].strip()
        if payload == b"[DONE]":
            self.done = True
            return event + b"\n\n"
        if b'"response":{' not in payload and b'"error"' not in payload:
            if _TEXT_DELTA in payload:
                self.usage.streamed += 1
            return event + b"\n\n"
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event + b"\n\n"
        if not isinstance(data, dict):
            return event + b"\n\n"
        kind = data.get("type")
        if kind == "error" or (kind is None and "error" in data):
            self.error = worker_error(500, payload)
            return error_event(self.error)
        response = data.get("response")
        if isinstance(response, dict):
            response["model"] = self._model
            response["service_tier"] = self._tier
            self.usage.take(response.get("usage"))
            self.done = self.done or kind in TERMINAL
        return head + b"data: " + orjson.dumps(data) + b"\n\n"
