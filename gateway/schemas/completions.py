"""Body of `POST /v1/completions`: `OpenAICompletionsIn` of the seed OpenAPI spec."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field, StrictInt, Tag
from pydantic_core import PydanticCustomError

from gateway.schemas.common import GatewayRequest, OpenModel, TokenId, by_shape

_ONE_PROMPT = (
    "Input should be one prompt per request: a string, a list holding one string, or a list "
    "of token ids"
)


def _one_prompt(value: Any) -> Any:
    """A list holding one string is that string (LangChain's completions client sends one);
    a list of several strings, or of lists, is a batch: one prompt per request; an empty
    list is no prompt (a worker would refuse it after the request took a slot)."""
    if isinstance(value, list) and not value:
        raise PydanticCustomError("one_prompt", _ONE_PROMPT)
    if isinstance(value, list) and isinstance(value[0], str | list):
        if len(value) == 1 and isinstance(value[0], str):
            return value[0]
        raise PydanticCustomError("one_prompt", _ONE_PROMPT)
    return value


def _one_string_list(schema: dict[str, Any]) -> None:
    """The published schema admits what the validator does: a list holding one string."""
    schema["oneOf"] = [
        *schema.get("oneOf", []),
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
    ]


Prompt = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[TokenId], Tag("list"), Field(min_length=1)],
    by_shape("a string or a list of token ids"),
    BeforeValidator(_one_prompt),
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

    # One prompt per request, as the seed has it: text or token ids (real integers, not
    # numeric strings). A list of one string is accepted as that string, and forwarded so.
    prompt: Prompt = Field(
        description=(
            "input prompt - a single string (or a list holding one string) or a list of token ids"
        ),
        json_schema_extra=_one_string_list,
    )
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

    def for_worker(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The caller's body with a one-string list prompt as the string the seed expects."""
        if isinstance(self.prompt, str) and not isinstance(payload.get("prompt"), str):
            return {**payload, "prompt": self.prompt}
        return payload
