"""The requests of the real-worker tests, through the official openai SDK: a chat or a
completion of a fixed length (temperature 0, a seed, `ignore_eos`, which both servers
take), so that the same request counts the same tokens wherever it is sent."""

from __future__ import annotations

import uuid
from typing import Any, Literal

import openai

Kind = Literal["chat", "completions"]
MESSAGES = [{"role": "user", "content": "hello world"}]
PROMPT = "one two three four"


def rid() -> str:
    return f"rw-{uuid.uuid4().hex}"


def create(client: openai.OpenAI, kind: Kind, model: str, max_tokens: int, **more: Any) -> Any:
    """The request; `request_id` becomes its x-request-id, `prompt` replaces the usual one,
    `raw` asks the SDK for the raw response (status and headers)."""
    headers = {"x-request-id": more.pop("request_id")} if "request_id" in more else {}
    prompt = more.pop("prompt", PROMPT)
    api: Any = client.chat.completions if kind == "chat" else client.completions
    if more.pop("raw", False):
        api = api.with_raw_response
    common: dict[str, Any] = dict(
        model=model,
        max_tokens=max_tokens,
        temperature=0,
        seed=0,
        extra_body={"ignore_eos": True},
        extra_headers=headers,
        **more,
    )
    if kind == "chat":
        messages = MESSAGES if prompt == PROMPT else [{"role": "user", "content": prompt}]
        return api.create(messages=messages, **common)
    return api.create(prompt=prompt, **common)


def counts(usage: Any) -> tuple[int, int]:
    """(prompt_tokens, completion_tokens) of an SDK usage object or a usage record."""
    if isinstance(usage, dict):
        return int(usage["prompt_tokens"]), int(usage["completion_tokens"])
    return usage.prompt_tokens, usage.completion_tokens


def piece(chunk: Any, kind: Kind) -> str:
    """The loop of every tutorial: `chunk.choices[0]` with no guard for empty choices."""
    choice = chunk.choices[0]
    return (choice.delta.content or "") if kind == "chat" else choice.text
