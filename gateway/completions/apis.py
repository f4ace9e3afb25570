"""The routes the gateway admits and forwards, one row each: its path, its body's schema,
the name a model's config lists it by (`models.<m>.serves`), and how its answers are read
on the way back. Adding a route is a row here (and its schema); the walk is the same."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.completions.answer import StreamRewriter
from gateway.completions.responsestream import ResponsesRewriter
from gateway.schemas import ChatRequest, CompletionRequest, EmbeddingsRequest, ResponsesRequest
from gateway.schemas.common import RoutedRequest
from routing.registry import Api


@dataclass(frozen=True, slots=True)
class Route:
    name: Api
    path: str
    schema: type[RoutedRequest]
    # The SSE rewriting of its streams (None: it never streams).
    stream: type[StreamRewriter] | None
    # The OpenAPI document's words for it: summary, operation id, schema title.
    summary: str
    operation: str
    title: str


ROUTES = (
    Route("completions", "/v1/completions", CompletionRequest, StreamRewriter,
          "Completions", "completions", "OpenAICompletionsIn"),
    Route("chat", "/v1/chat/completions", ChatRequest, StreamRewriter,
          "Chat Completions", "chat_completions", "OpenAIChatCompletionsIn"),
    Route("responses", "/v1/responses", ResponsesRequest, ResponsesRewriter,
          "Responses", "responses", "ResponsesIn"),
    Route("embeddings", "/v1/embeddings", EmbeddingsRequest, None,
          "Embeddings", "embeddings", "EmbeddingsIn"),
)  # fmt: skip
