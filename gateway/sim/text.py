"""What the simulated worker says: request parsing, deterministic text and the reply bodies.

Pure functions and frozen records, no I/O, so `gateway.sim.worker` stays about timing and HTTP.
One word is one token; the words come from a fixed list, picked by a PRNG seeded from the
request's `seed` and its prompt, so the same request always gets the same answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import orjson

WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "it", "for", "was", "on", "are", "as",
    "with", "they", "at", "be", "this", "from", "have", "or", "by", "one", "had", "not",
    "but", "what", "all", "were", "when", "we", "there", "can", "an", "your", "which",
    "their", "said", "if", "do", "will", "each", "about", "how", "up", "out", "them", "then",
    "she", "many", "some", "so", "these", "would", "other", "into", "has", "more", "two",
    "like", "time", "see", "way", "could", "people", "than", "first", "water", "been",
    "call", "who", "now", "find", "long", "down", "day", "did", "get", "come", "made", "may",
    "part", "model", "token", "river", "stone", "light", "signal", "garden", "engine",
)  # fmt: skip

DONE_EVENT = b"data: [DONE]\n\n"


class BadRequest(ValueError):
    """The request body is not a valid completion request; answered with a vLLM-style 400."""


@dataclass(frozen=True, slots=True)
class Job:
    """A validated generation request, reduced to what the simulator uses."""

    chat: bool
    model: str
    # One per prompt (a batch of completions has several): each seeds the PRNG with `seed`.
    prompt_keys: tuple[str, ...]
    prompt_tokens: int  # all prompts together
    seed: int
    n: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    # vLLM's `continuous_usage_stats`: the usage so far on every chunk (with include_usage).
    continuous_usage: bool = False


@dataclass(frozen=True, slots=True)
class Plan:
    """The tokens each choice will emit and why generation ends."""

    tokens: tuple[tuple[str, ...], ...]  # per choice; the first word bare, the others " word"
    finish_reason: str  # "stop" or "length"

    @property
    def length(self) -> int:
        return len(self.tokens[0])

    @property
    def choices(self) -> int:
        return len(self.tokens)

    @property
    def completion_tokens(self) -> int:
        return sum(len(choice) for choice in self.tokens)


def parse_job(body: object, chat: bool, default_model: str) -> Job:
    """Validate a /v1/completions (chat=False) or /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    model = body.get("model", default_model)
    if not isinstance(model, str):
        raise BadRequest("`model` must be a string.")
    if chat:
        prompt_keys, prompt_tokens = chat_prompt(body.get("messages"))
        max_tokens = opt_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = opt_int(body, "max_tokens", 1)
    else:
        prompt_keys, prompt_tokens = prompts(body.get("prompt"))
        max_tokens = opt_int(body, "max_tokens", 1)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("`stream` must be a boolean.")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("`stream_options` must be an object.")
    return Job(
        chat=chat,
        model=model,
        prompt_keys=prompt_keys,
        prompt_tokens=prompt_tokens,
        seed=opt_int(body, "seed", None) or 0,
        n=opt_int(body, "n", 1) or 1,
        max_tokens=max_tokens,
        stream=bool(stream),
        include_usage=bool(options and options.get("include_usage") is True),
        continuous_usage=bool(options and options.get("continuous_usage_stats") is True),
    )


def opt_int(body: dict[str, Any], name: str, minimum: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"`{name}` must be an integer.")
    if minimum is not None and value < minimum:
        raise BadRequest(f"`{name}` must be at least {minimum}, got {value}.")
    return value


def prompts(prompt: object) -> tuple[tuple[str, ...], int]:
    """One prompt, or (as vLLM takes them) a list of texts or of token-id lists."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        found = [_text_prompt(p) for p in prompt]
        return tuple(key for key, _ in found), sum(count for _, count in found)
    key, count = _text_prompt(prompt)
    return (key,), count


def _text_prompt(prompt: object) -> tuple[str, int]:
    if isinstance(prompt, str):
        return prompt, len(prompt.split())
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return orjson.dumps(prompt).decode(), len(prompt)
    raise BadRequest("`prompt` must be a string or a non-empty list of token ids.")


def chat_prompt(messages: object) -> tuple[tuple[str, ...], int]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty list.")
    lines: list[str] = []
    count = 0
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("Each message must be an object with a string `role`.")
        text = _content_text(message.get("content"))
        count += len(text.split())
        lines.append(f"{message['role']}: {text}")
    return ("\n".join(lines),), count


# Text parts: chat's, and the Responses API's input (and earlier output) items.
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def _content_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise BadRequest("Each content part must be an object with a string `type`.")
            if part["type"] in _TEXT_PARTS:
                if not isinstance(part.get("text"), str):
                    raise BadRequest("A text content part needs a string `text`.")
                texts.append(part["text"])
        return " ".join(texts)
    raise BadRequest("Message `content` must be a string, a list of parts or null.")


def make_plan(job: Job, natural_tokens: int) -> Plan:
    """Choose the words: the natural answer has `natural_tokens`, max_tokens may cut it."""
    length = natural_tokens
    finish_reason = "stop"
    if job.max_tokens is not None and job.max_tokens < natural_tokens:
        length, finish_reason = job.max_tokens, "length"
    choices = []
    for key in job.prompt_keys:  # as vLLM indexes them: prompt by prompt, `n` each
        for index in range(job.n):
            rng = random.Random(f"{job.seed}\x00{index}\x00{key}")
            words = rng.choices(WORDS, k=length)
            choices.append(tuple(w if i == 0 else " " + w for i, w in enumerate(words)))
    return Plan(tuple(choices), finish_reason)


def error_body(status: int, kind: str, message: str) -> dict[str, Any]:
    """vLLM's error shape, e.g. kind "NotFoundError" for 404."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


# What vLLM says in `system_fingerprint` (its version and a hash of its config).
FINGERPRINT = "vllm-0.32.0-simulated"
# Fields vLLM 0.32 sends as null when it has nothing for them (tests/gateway/sim/vllm/ holds its
# own answers, which tests/gateway/sim/test_sim_fidelity.py compares field for field).
_CHAT_TOP = ("prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
             "ec_transfer_params", "metrics")  # fmt: skip
_COMPLETION_TOP = ("kv_transfer_params", "ec_transfer_params", "metrics")
_MESSAGE = ("refusal", "annotations", "audio", "function_call", "reasoning")


@dataclass(frozen=True, slots=True)
class Reply:
    """Builds the JSON body, or the SSE events, of one answer, as vLLM 0.32 writes them."""

    job: Job
    plan: Plan
    rid: str
    created: int

    def usage(self, completion: int | None = None) -> dict[str, Any]:
        """The request's usage; `completion`: so many tokens so far (a chunk's, continuous)."""
        prompt = self.job.prompt_tokens
        if completion is None:
            completion = self.plan.completion_tokens
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }

    def body(self) -> dict[str, Any]:
        choices = []
        for index, tokens in enumerate(self.plan.tokens):
            text = "".join(tokens)
            choice: dict[str, Any] = {"index": index}
            if self.job.chat:
                choice["message"] = {"role": "assistant", "content": text, **nulls(_MESSAGE)}
            else:
                choice["text"] = text
            choice.update(logprobs=None, finish_reason=self.plan.finish_reason, stop_reason=None,
                          token_ids=None)  # fmt: skip
            if not self.job.chat:
                choice.update(prompt_logprobs=None, prompt_token_ids=None)
            choice["routed_experts"] = None
            choices.append(choice)
        obj = "chat.completion" if self.job.chat else "text_completion"
        usage = {**self.usage(), "prompt_tokens_details": None, "completion_tokens_details": None}
        return {
            **self._head(obj), "choices": choices, "service_tier": None,
            "system_fingerprint": FINGERPRINT, "usage": usage,
            **nulls(_CHAT_TOP if self.job.chat else _COMPLETION_TOP),
        }  # fmt: skip

    def role_events(self) -> list[bytes]:
        """Chat streams open each choice with the assistant role, like vLLM."""
        if not self.job.chat:
            return []
        events = []
        for index in range(self.plan.choices):
            choice = {"index": index, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}  # fmt: skip
            chunk = {**self._head("chat.completion.chunk"), "choices": [choice]}
            if self.job.continuous_usage:
                chunk["usage"] = {**self.usage(0), "completion_tokens_details": None}
            events.append(_event({**chunk, "prompt_token_ids": None, "prompt_text": None}))
        return events

    def token_event(self, index: int, step: int) -> bytes:
        last = step == self.plan.length - 1
        token = self.plan.tokens[index][step]
        delta = {"content": token} if self.job.chat else token
        return self._chunk(index, delta, self.plan.finish_reason if last else None, step + 1)

    def closing_events(self) -> list[bytes]:
        """Finish chunks not already sent with a last token, the usage chunk, then [DONE]."""
        events: list[bytes] = []
        if self.plan.length == 0:
            empty: dict[str, str] | str = {"content": ""} if self.job.chat else ""
            finish = self.plan.finish_reason
            events = [self._chunk(i, empty, finish, 0) for i in range(self.plan.choices)]
        if self.job.include_usage:
            head = self._head("chat.completion.chunk" if self.job.chat else "text_completion")
            usage = {"choices": [], "usage": self.usage(), "system_fingerprint": FINGERPRINT}
            events.append(_event({**head, **usage}))
        events.append(DONE_EVENT)
        return events

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.job.model}

    def _chunk(
        self, index: int, delta: dict[str, str] | str, finish: str | None, so_far: int
    ) -> bytes:
        choice: dict[str, Any] = {"index": index}
        if self.job.chat:
            head = self._head("chat.completion.chunk")
            choice.update(delta=delta, logprobs=None, finish_reason=finish)
            if finish is not None:
                choice["stop_reason"] = None
        else:
            head = self._head("text_completion")
            choice.update(text=delta, logprobs=None, finish_reason=finish, stop_reason=None,
                          prompt_token_ids=None)  # fmt: skip
        chunk = {**head, "choices": [{**choice, "token_ids": None}]}
        if self.job.continuous_usage:
            usage = self.usage(so_far)
            chunk["usage"] = (
                {**usage, "completion_tokens_details": None} if self.job.chat else usage
            )
        if finish is not None and not self.job.include_usage:
            chunk["system_fingerprint"] = FINGERPRINT
        return _event(chunk)


def nulls(names: tuple[str, ...]) -> dict[str, None]:
    return dict.fromkeys(names)


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
