"""Request bodies of the two POST routes, validated before anything is forwarded."""

from gateway.schemas.chat import ChatRequest
from gateway.schemas.completions import CompletionRequest

__all__ = ["ChatRequest", "CompletionRequest"]
