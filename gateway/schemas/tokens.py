"""What a request will hold of a worker's KV cache, estimated from its body before any
worker sees it (docs/api.md, token budgets): its prompt's tokens, and the answer it asks
for. Cheap on purpose (no tokenizer): the bytes of its text over 4, which overestimates
plain English (about 4.5 bytes a token with its space) and code alike; the reservation's
error never accumulates, since a release gives back exactly what was reserved.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.schemas.chat import ChatRequest, ImageUrlPart, OtherPart, TextPart
from gateway.schemas.common import RoutedRequest
from gateway.schemas.completions import CompletionRequest
from gateway.schemas.embeddings import EmbeddingsRequest
from gateway.schemas.responses import ResponsesRequest

BYTES_PER_TOKEN = 4
# What a chat template adds around each message (role markers, separators).
PER_MESSAGE = 4
# An image, audio or video part: what its encoder adds, roughly (its bytes say nothing).
PER_MEDIA = 1024


def prompt_tokens(request: RoutedRequest) -> int:
    if isinstance(request, CompletionRequest):
        data = request.data
        text = _prompt(request.prompt)
        # Its images and videos (`data`): each what an encoder adds, as a chat's media parts.
        return text + (PER_MEDIA * (len(data.image) + len(data.video)) if data else 0)
    if isinstance(request, ChatRequest):
        total = 0
        for message in request.messages:
            total += PER_MESSAGE + _content(message.content)
            for call in getattr(message, "tool_calls", None) or ():
                total += _text(call.function.name) + _text(call.function.arguments)
        # The tools offered count too (the chat template writes them into the prompt), from
        # the body as it is forwarded: gateway/completions/exchange.py `tools_tokens`.
        return total
    if isinstance(request, ResponsesRequest):
        # Its input items (messages, tool results) by their bytes, as a chat's tools are;
        # its tools alike, from the forwarded body (gateway/completions/exchange.py).
        found = request.input
        items = _text(found) if isinstance(found, str) else len(orjson.dumps(
            [item.model_dump() for item in found])) // BYTES_PER_TOKEN  # fmt: skip
        return items + _text(request.instructions or "")
    if isinstance(request, EmbeddingsRequest):
        return _prompt(request.input)
    return 0


def sequences(request: RoutedRequest) -> int:
    """How many answers it asks for: `n` for each of its prompts (a batch's, else one)."""
    if isinstance(request, CompletionRequest):
        return request.n * request.prompt_count
    if isinstance(request, ChatRequest):
        return request.n
    return 1


def _prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> int:
    """Text's estimate, token ids counted; a batch's prompts summed."""
    if isinstance(prompt, str):
        return _text(prompt)
    return sum(
        _text(p) if isinstance(p, str) else len(p) if isinstance(p, list) else 1 for p in prompt
    )


def output_tokens(request: RoutedRequest) -> int | None:
    """The answer's length the caller asked for (max_tokens, chat's max_completion_tokens,
    the Responses API's max_output_tokens), None when it named none; an embedding has none."""
    if isinstance(request, EmbeddingsRequest):
        return 0
    if isinstance(request, ResponsesRequest):
        return request.max_output_tokens
    if not isinstance(request, CompletionRequest | ChatRequest):
        return None
    if request.max_tokens is not None:
        return int(request.max_tokens)
    extra = request.model_extra or {}
    named = extra.get("max_completion_tokens")
    if isinstance(named, int) and not isinstance(named, bool) and named > 0:
        return named
    return None


def _content(content: Any) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return _text(content)
    total = 0
    for part in content:
        if isinstance(part, TextPart):
            total += _text(part.text)
        elif isinstance(part, ImageUrlPart | OtherPart):
            total += PER_MEDIA
    return total


def _text(text: str) -> int:
    return -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)
