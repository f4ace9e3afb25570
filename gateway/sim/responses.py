"""What the simulated worker says on `/v1/responses` (OpenAI's Responses API, as vLLM serves
it: a response object, or its event stream ending with `response.completed`) and on
`/v1/embeddings` (deterministic vectors; the usage is the input alone)."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.sim.text import BadRequest, Job, Reply, chat_prompt, nulls, opt_int, prompts

# An embedding's length when the request names no `dimensions`.
DIMENSIONS = 8


def parse_responses_job(body: object, default_model: str) -> Job:
    """A /v1/responses body: `input` text or messages, `instructions`, `max_output_tokens`."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    model = body.get("model", default_model)
    found = body.get("input")
    if isinstance(found, str):
        messages: object = [{"role": "user", "content": found}]
    elif isinstance(found, list) and found:
        messages = found
    else:
        raise BadRequest("`input` must be a string or a non-empty list of items.")
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        messages = [{"role": "system", "content": instructions}, *messages]  # type: ignore[misc]
    keys, tokens = chat_prompt(messages)
    stream = body.get("stream") is True
    return Job(chat=False, model=str(model), prompt_keys=keys, prompt_tokens=tokens,
               seed=opt_int(body, "seed", None) or 0, n=1,
               max_tokens=opt_int(body, "max_output_tokens", 1), stream=stream,
               include_usage=False)  # fmt: skip


def parse_embeddings_job(body: object, default_model: str) -> Job:
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    keys, tokens = prompts(body.get("input"))
    dimensions = opt_int(body, "dimensions", 1) or DIMENSIONS
    return Job(chat=False, model=str(body.get("model", default_model)), prompt_keys=keys,
               prompt_tokens=tokens, seed=dimensions, n=1, max_tokens=0, stream=False,
               include_usage=False)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ResponsesReply(Reply):
    """A response object, or its events (sequence numbers in order, one delta a token)."""

    def usage(self, completion: int | None = None) -> dict[str, Any]:
        prompt, done = self.job.prompt_tokens, self.plan.completion_tokens
        inputs = {"cached_tokens": 0, "cache_write_tokens": 0, "input_tokens_per_turn": [],
                  "cached_tokens_per_turn": []}  # fmt: skip
        outputs = {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                   "tool_output_tokens_per_turn": []}  # fmt: skip
        return {"input_tokens": prompt, "input_tokens_details": inputs, "output_tokens": done,
                "output_tokens_details": outputs, "total_tokens": prompt + done}  # fmt: skip

    def body(self) -> dict[str, Any]:
        return self._response(complete=True)

    # The events' sequence numbers, as vLLM gives them: from 0, one each, in order.
    def role_events(self) -> list[bytes]:
        item = {**self._message(""), "status": "in_progress", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            _event(0, "response.created", response=self._response(complete=False)),
            _event(1, "response.in_progress", response=self._response(complete=False)),
            _event(2, "response.output_item.added", output_index=0, item=item),
            _event(3, "response.content_part.added", output_index=0, content_index=0,
                   item_id=item["id"], part=part),
        ]  # fmt: skip

    def token_event(self, index: int, step: int) -> bytes:
        return _event(4 + step, "response.output_text.delta", output_index=0, content_index=0,
                      item_id=self._item_id, delta=self.plan.tokens[0][step],
                      logprobs=[])  # fmt: skip

    def closing_events(self) -> list[bytes]:
        text = "".join(self.plan.tokens[0])
        message = self._message(text)
        at = 4 + self.plan.length
        return [
            _event(at, "response.output_text.done", output_index=0, content_index=0,
                   item_id=self._item_id, text=text, logprobs=[]),
            _event(at + 1, "response.content_part.done", output_index=0, content_index=0,
                   item_id=self._item_id, part=message["content"][0]),
            _event(at + 2, "response.output_item.done", output_index=0, item=message),
            _event(at + 3, "response.completed", response=self._response(complete=True)),
        ]  # fmt: skip

    @property
    def _item_id(self) -> str:
        return "msg_" + self.rid.removeprefix("resp_")

    def _message(self, text: str) -> dict[str, Any]:
        content: list[dict[str, Any]] = [
            {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
        ]
        return {"id": self._item_id, "type": "message", "role": "assistant",
                "status": "completed", "content": content, "phase": None}  # fmt: skip

    def _response(self, *, complete: bool) -> dict[str, Any]:
        cut = self.plan.finish_reason == "length"
        status = ("incomplete" if cut else "completed") if complete else "in_progress"
        return {
            "id": self.rid, "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"} if complete and cut else None,
            "instructions": None, "metadata": None, "model": self.job.model,
            "object": "response",
            "output": [self._message("".join(self.plan.tokens[0]))] if complete else [],
            "parallel_tool_calls": True, "temperature": 1.0, "tool_choice": "none",
            "tools": [], "top_p": 1.0, "background": False,
            "max_output_tokens": self.job.max_tokens, **nulls(_RESPONSE_NULLS),
            "service_tier": "auto", "status": status, "truncation": "disabled",
            "usage": self.usage() if complete else None, "user": None,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, **nulls(_RESPONSE_TAIL),
        }  # fmt: skip


_RESPONSE_NULLS = ("max_tool_calls", "previous_response_id", "prompt", "reasoning", "text",
                   "top_logprobs")  # fmt: skip
_RESPONSE_TAIL = ("kv_transfer_params", "ec_transfer_params", "input_messages",
                  "output_messages")  # fmt: skip


def _event(number: int, kind: str, **fields: Any) -> bytes:
    payload = orjson.dumps({"type": kind, "sequence_number": number, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"


@dataclass(frozen=True, slots=True)
class EmbeddingsReply(Reply):
    """A list of vectors, one per input, from a hash of each (the same input, the same one)."""

    def body(self) -> dict[str, Any]:
        data = [
            {"object": "embedding", "index": i, "embedding": _vector(key, self.job.seed)}
            for i, key in enumerate(self.job.prompt_keys)
        ]
        prompt = self.job.prompt_tokens
        usage = {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0,
                 "prompt_tokens_details": None}  # fmt: skip
        return {"id": self.rid, "object": "list", "created": self.created,
                "model": self.job.model, "data": data, "usage": usage}  # fmt: skip


def _vector(key: str, dimensions: int) -> list[float]:
    seed = key.encode()
    out: list[float] = []
    while len(out) < dimensions:
        seed = hashlib.sha256(seed).digest()
        out += [v / 2**31 for v in struct.unpack("<8i", seed)]
    return out[:dimensions]
