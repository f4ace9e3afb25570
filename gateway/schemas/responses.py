"""Body of `POST /v1/responses` (OpenAI's Responses API, which vLLM serves): what the gateway
needs of it checked (the input, the answer's length, sampling bounds), the rest forwarded."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StrictFloat, Tag

from gateway.schemas.common import GeneratingRequest, MaxTokens, OpenModel, by_shape

# Items of an input list (messages, tool outputs, ...), at most.
MAX_INPUT_ITEMS = 4096

InputItems = Annotated[list[OpenModel], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
ResponsesInput = Annotated[
    Annotated[str, Tag("str")] | Annotated[InputItems, Tag("list")],
    by_shape("a string or a list of input items"),
]


class ResponsesRequest(GeneratingRequest):
    model_config = ConfigDict(title="ResponsesIn")

    input: ResponsesInput = Field(
        description="The text, or the list of input items (messages, tool results)"
    )
    instructions: str | None = Field(default=None, description="A system message first")
    max_output_tokens: MaxTokens | None = Field(
        default=None, description="The most tokens the answer may have, reasoning included"
    )
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] | None = None
    tools: list[OpenModel] | None = Field(default=None, max_length=512)
    # A background response runs on after its request has ended: the fleet could not count
    # what it holds, so the gateway does not take one.
    background: Literal[False] | None = Field(
        default=None, description="Not supported here: every response runs in its request"
    )
