"""Body of `POST /v1/completions`: `OpenAICompletionsIn` of the seed OpenAPI spec."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Discriminator, Field, StrictInt, Tag

from gateway.schemas.common import GatewayRequest, OpenModel, TokenId

# A list of prompts is one request holding several (OpenAI's and vLLM's batch form): its
# admission reserves every one, its answer has one choice per prompt and `n`.
MAX_PROMPTS = 64


def one_string(value: Any) -> Any:
    """A list holding one string is that string (LangChain's completions client sends one)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    return value


def _prompt_shape(value: Any) -> str | None:
    """Text, token ids, or a batch of either: told by the value and its first element."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    if isinstance(first, str):
        return "texts"
    return "batch" if isinstance(first, list) else "list"


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


PROMPT_SHAPE = Discriminator(
    _prompt_shape,
    custom_error_type="shape_error",
    custom_error_message="Input should be a string, a list of token ids, or a list of such prompts",
)
# Text or token ids, or a list of at most MAX_PROMPTS of either (a batch).
Prompt = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[TokenIds, Tag("list")]
    | Annotated[list[str], Tag("texts"), Field(min_length=1, max_length=MAX_PROMPTS)]
    | Annotated[list[TokenIds], Tag("batch"), Field(min_length=1, max_length=MAX_PROMPTS)],
    PROMPT_SHAPE,
    BeforeValidator(one_string),
]


def prompt_count(prompt: str | list[int] | list[str] | list[list[int]]) -> int:
    """How many prompts a batch holds (a single one, text or token ids, is one)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1


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

    # Text or token ids (real integers, not numeric strings), or a batch of either. A list
    # of one string is accepted as that string, and forwarded so.
    prompt: Prompt = Field(
        description=(
            "input prompt - a string or a list of token ids; or a list of up to "
            f"{MAX_PROMPTS} such prompts, each answered with its own choices"
        ),
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

    @property
    def prompt_count(self) -> int:
        """How many prompts it holds (a batch's; else one)."""
        return prompt_count(self.prompt)

    def for_worker(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The caller's body with a one-string list prompt as the string the seed expects."""
        if isinstance(self.prompt, str) and not isinstance(payload.get("prompt"), str):
            return {**payload, "prompt": self.prompt}
        return payload
