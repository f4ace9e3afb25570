"""Request bodies of the POST routes, validated before anything is forwarded."""

from gateway.schemas.chat import ChatRequest
from gateway.schemas.completions import CompletionRequest
from gateway.schemas.embeddings import EmbeddingsRequest
from gateway.schemas.responses import ResponsesRequest

__all__ = ["ChatRequest", "CompletionRequest", "EmbeddingsRequest", "ResponsesRequest"]
