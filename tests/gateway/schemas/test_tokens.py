"""A request's token estimate from its body (gateway/schemas/tokens.py): what it reserves of
a worker's KV cache and charges a tokens limit before any worker counts."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.completions.exchange import tools_tokens
from gateway.schemas.chat import ChatRequest
from gateway.schemas.completions import CompletionRequest
from gateway.schemas.tokens import (
    PER_MEDIA,
    PER_MESSAGE,
    output_tokens,
    prompt_tokens,
    sequences,
)

IMAGE = "data:image/png;base64,AAAA"


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


def chat(*content: Any, **fields: Any) -> ChatRequest:
    messages = [{"role": "user", "content": c} for c in content]
    return ChatRequest.model_validate({"model": "m", "messages": messages, **fields})


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [("", 0), ("abcd", 1), ("abcde", 2), ("\U0001f600", 1), (["one"], 1), ([7, 8, 9], 3)],
)
def test_a_completions_prompt(prompt: Any, tokens: int) -> None:
    assert prompt_tokens(completion(prompt=prompt)) == tokens


def test_a_batch_reserves_every_prompt_and_each_of_its_answers() -> None:
    """Two prompts (1 and 2 tokens, and one of token ids), n=2: every prompt in the
    cache, and n answers for each of them."""
    request = completion(prompt=["abcd", "abcdefgh", "abc"], n=2, max_tokens=5)
    assert (prompt_tokens(request), sequences(request)) == (4, 6)
    ids = completion(prompt=[[1, 2, 3], [4]], n=3)
    assert (prompt_tokens(ids), sequences(ids)) == (4, 6)
    assert sequences(completion(prompt=[1, 2, 3], n=3)) == 3  # one prompt of token ids
    assert sequences(chat("hi", n=2)) == 2


def test_a_completions_images_and_videos_count_as_media() -> None:
    # Multi-modal completions carry their media in `data`: each holds as much of the cache
    # as a chat's image part does, whatever the size of its base64.
    request = completion(prompt="abcd", data={"image": [IMAGE, IMAGE], "video": [IMAGE]})
    assert prompt_tokens(request) == 1 + 3 * PER_MEDIA
    assert prompt_tokens(completion(prompt="abcd", data={})) == 1


def test_a_chat_counts_its_messages_and_media() -> None:
    parts = [{"type": "text", "text": "abcd"}, {"type": "image_url", "image_url": {"url": IMAGE}}]
    assert prompt_tokens(chat("abcd", parts)) == 2 * PER_MESSAGE + 1 + 1 + PER_MEDIA


@pytest.mark.parametrize(
    ("fields", "asked"),
    [({}, None), ({"max_tokens": 7}, 7), ({"max_completion_tokens": 9}, 9),
     ({"max_completion_tokens": True}, None), ({"max_tokens": 3, "max_completion_tokens": 9}, 3)],
)  # fmt: skip
def test_the_answer_asked_for(fields: dict[str, Any], asked: int | None) -> None:
    assert output_tokens(chat("x", **fields)) == asked


def with_tools(request: ChatRequest) -> int:
    """Its prompt estimate with its tools, as admission asks (the tools from the body as
    it is forwarded: gateway/completions/exchange.py `Parsed.tokens`)."""
    tools = request.model_dump(mode="json", exclude_none=True).get("tools")
    return prompt_tokens(request) + tools_tokens(tools)


def test_a_chats_tools_count_as_the_prompt_they_become() -> None:
    # The chat template writes the tools' definitions into the prompt: a large schema holds
    # as much of the cache as the same bytes of text would.
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50)}}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": schema}}]
    bare, offered = with_tools(chat("abcd")), with_tools(chat("abcd", tools=tools))
    assert offered - bare >= len(str(schema)) // 8  # compact JSON, over 4, and then some
    assert with_tools(chat("abcd", tools=[])) == bare


def test_tools_holding_an_integer_past_64_bits_are_counted() -> None:
    # The edge keeps such an integer exact (the stdlib parser; orjson would make it a lossy
    # float) and forwards it: its estimate must count it, not fail (a 500 for a valid body).
    big = 10**30
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": big}}}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": schema}}]
    bare, offered = with_tools(chat("abcd")), with_tools(chat("abcd", tools=tools))
    assert offered - bare >= len(str(big)) // 4
