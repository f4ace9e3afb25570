"""Body of `POST /v1/completions`: `OpenAICompletionsIn` of the seed OpenAPI spec."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field, StrictInt, Tag

from gateway.schemas.common import GatewayRequest, OpenModel, TokenId, by_shape

Prompt = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[TokenId], Tag("list")],
    by_shape("a string or a list of token ids"),
]


class CompletionMultiModalData(OpenModel):
    image: list[str] = Field(
        default_factory=list,
        description="List of images as base64 data URIs (e.g. 'data:image/png;base64,...').",
    )
    video: list[str] = Field(
        default_factory=list,
        description="List of videos as base64 data URIs (e.g. 'data:video/mp4;base64,...').",
    )


class CompletionRequest(GatewayRequest):
    model_config = ConfigDict(title="OpenAICompletionsIn")

    # A list of strings (a batch of prompts) is refused: the seed accepts one prompt, given
    # as text or as token ids, and token ids must be real integers, not numeric strings.
    prompt: Prompt = Field(description="input prompt - a single string or a list of token ids")
    logprobs: Annotated[StrictInt, Field(ge=0)] | None = Field(
        default=None, description="return top tokens and their log-probabilities"
    )
    data: CompletionMultiModalData | None = Field(
        default=None,
        description=(
            "Optional multi-modal data to pass alongside the prompt. Images must be base64 "
            "data URIs (e.g. 'data:image/png;base64,...')."
        ),
    )
