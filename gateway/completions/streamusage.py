"""Where a stream's usage reaches the caller (docs/api.md, streaming).

The worker is always asked for its usage (billing needs it); what the caller sees follows
its `stream_options`:

| the request | the caller sees |
|---|---|
| absent, or without `include_usage` | the usage on the last chunk carrying a `finish_reason` |
| `include_usage: true` | OpenAI's form: a last chunk `{"choices": [], "usage": ...}` |
| `include_usage: false` | no usage anywhere |
| `continuous_usage_stats: true` | besides, the usage on every chunk, as vLLM sends it |

The first row is the seeds' streaming form, and the one every tutorial's loop survives
(`chunk.choices[0].delta`): no chunk of it has empty `choices`. A worker that sends its
usage apart from the finish chunk (vLLM, OpenAI's form) has its finish chunk held until the
usage arrives, or the stream ends; the usage is then merged into it. Nothing else is held:
a chunk after a held one sends the held one first.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.schemas.common import StreamOptions


class UsageForm(enum.Enum):
    FINISH = "finish"  # on the last finish chunk (the seeds' form, the default)
    CHUNK = "chunk"  # OpenAI's own last chunk with empty choices
    NONE = "none"  # nowhere


@dataclass(frozen=True, slots=True)
class StreamUsage:
    """What the caller asked to see of a stream's usage."""

    form: UsageForm = UsageForm.FINISH
    continuous: bool = False

    @classmethod
    def of(cls, options: StreamOptions | None) -> StreamUsage:
        if options is None:
            return cls()
        form = UsageForm.FINISH
        if "include_usage" in options.model_fields_set:
            form = UsageForm.CHUNK if options.include_usage else UsageForm.NONE
        continuous = options.continuous_usage_stats and form is not UsageForm.NONE
        return cls(form, continuous)


def event(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


class UsageShaper:
    """One stream's usage, placed as its caller asked (the module's table). Fed every
    parsed chunk (`shape`) and told of every chunk that passes unparsed (`release`)."""

    __slots__ = ("_held", "_owed", "_shown", "continuous", "form")

    def __init__(self, wanted: StreamUsage) -> None:
        self.form = wanted.form
        self.continuous = wanted.continuous
        self._held: dict[str, Any] | None = None  # a finish chunk waiting for the usage
        self._owed: dict[str, Any] | None = None  # OpenAI's usage chunk, still to send
        self._shown = False  # the caller has seen the usage

    def may_pass(self, payload: bytes) -> bool:
        """Whether a chunk may pass without a look at its usage or finish: never one with
        a usage object, nor (without usage wanted) a `usage` key, nor (the seeds' form) a
        finish that may have to wait for its usage."""
        if b'"usage":{' in payload:
            return False
        if self.form is UsageForm.NONE:
            return b'"usage"' not in payload
        if self.form is UsageForm.FINISH:
            # Unfinished chunks say `"finish_reason":null`; any other count is a finish
            # (or a spelling with spaces, looked at to be sure).
            return payload.count(b'"finish_reason"') == payload.count(b'"finish_reason":null')
        return True

    def release(self) -> bytes:
        """The held finish chunk, now (something else follows it, so it is not the last):
        without usage, unless the caller wants it on every chunk."""
        held = self._held
        if held is None:
            return b""
        self._held = None
        if not self.continuous and isinstance(held.get("usage"), dict):
            del held["usage"]
        return event(held)

    def shape(self, data: dict[str, Any]) -> bytes:
        """What the caller gets for this chunk: the bytes to send now (maybe none)."""
        choices = data.get("choices")
        usage = data.get("usage")
        only_usage = choices == [] and "usage" in data
        if self.form is UsageForm.NONE:
            if only_usage:
                return b""
            data.pop("usage", None)
            return event(data)
        if self.form is UsageForm.CHUNK:
            return self._openai(data, usage, only_usage)
        return self._on_finish(data, usage, only_usage, _finished(choices))

    def _openai(self, data: dict[str, Any], usage: Any, only_usage: bool) -> bytes:
        if only_usage:
            self._shown = self._shown or isinstance(usage, dict)
            return event(data)
        if isinstance(usage, dict) and not self.continuous:
            # On a chunk with choices (llama.cpp's last one): moved to OpenAI's own chunk.
            data["usage"] = None
            self._owed = {**_head(data), "choices": [], "usage": usage}
        return event(data)

    def _on_finish(
        self, data: dict[str, Any], usage: Any, only_usage: bool, finished: bool
    ) -> bytes:
        if only_usage:
            held, self._held = self._held, None
            if held is None:
                return b""
            if isinstance(usage, dict):  # the request's (a finish chunk's may be one choice's)
                held["usage"] = usage
            return event(held)
        before = self.release()
        if finished:
            self._held = data  # the request's usage may follow in a chunk of its own
            return before
        if not self.continuous and isinstance(usage, dict):
            del data["usage"]  # a null one passes, as on the chunks not looked at
        return before + event(data)

    def end(self, done: bool) -> bytes:
        """What is still owed the caller as the stream ends: the held finish chunk, and
        (OpenAI's form, at `[DONE]`) the usage chunk the worker did not send apart."""
        held, self._held = self._held, None
        out = b"" if held is None else event(held)  # the last: with the usage it has
        owed, self._owed = self._owed, None
        if done and owed is not None and not self._shown:
            out += event(owed)
        return out


def _finished(choices: Any) -> bool:
    if not isinstance(choices, list):
        return False
    return any(isinstance(c, dict) and c.get("finish_reason") is not None for c in choices)


_HEAD = ("id", "object", "created", "model", "service_tier", "system_fingerprint")


def _head(data: dict[str, Any]) -> dict[str, Any]:
    return {k: data[k] for k in _HEAD if k in data}
