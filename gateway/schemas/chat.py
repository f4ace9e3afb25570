"""Body of `POST /v1/chat/completions`, after the chat reference of the seeds."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, StrictBool, StrictInt, Tag

from gateway.schemas.common import GatewayRequest, OpenModel, by_shape

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class TextPart(OpenModel):
    type: Literal["text"]
    text: str


class ImageUrl(OpenModel):
    url: str
    detail: str | None = None


class ImageUrlPart(OpenModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class OtherPart(OpenModel):
    """Any other part (input_audio, video_url, audio_url, file, ...), forwarded untouched."""

    # The schema excludes the two checked types so that its `oneOf` stays exclusive.
    type: str = Field(json_schema_extra={"not": {"enum": ["text", "image_url"]}})


def _user_part_tag(value: Any) -> str | None:
    # A callable discriminator, because a plain union would let a malformed text or
    # image_url part slip through as "some other part".
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind is None:
        return None
    if isinstance(kind, str) and kind in ("text", "image_url"):
        return kind
    return "other"


UserPart = Annotated[
    Annotated[TextPart, Tag("text")]
    | Annotated[ImageUrlPart, Tag("image_url")]
    | Annotated[OtherPart, Tag("other")],
    Discriminator(
        _user_part_tag,
        custom_error_type="invalid_content_part",
        custom_error_message="Each content part must be an object with a 'type'",
    ),
]

TextContent = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[TextPart], Tag("list")],
    by_shape("a string or a list of text parts"),
]
UserContent = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[UserPart], Tag("list")],
    by_shape("a string or a list of content parts"),
]


class ChatCompletionSystemMessage(OpenModel):
    role: Literal["system"]
    content: TextContent
    name: str | None = None


class ChatCompletionDeveloperMessage(OpenModel):
    """OpenAI's newer name for the system message; the OpenAI SDK sends it."""

    role: Literal["developer"]
    content: TextContent
    name: str | None = None


class ChatCompletionUserMessage(OpenModel):
    role: Literal["user"]
    content: UserContent
    name: str | None = None


class FunctionCall(OpenModel):
    name: str
    arguments: str


class ToolCall(OpenModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatCompletionAssistantMessage(OpenModel):
    role: Literal["assistant"]
    content: TextContent | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None


class ChatCompletionToolMessage(OpenModel):
    role: Literal["tool"]
    content: TextContent
    tool_call_id: str


ChatMessage = Annotated[
    ChatCompletionSystemMessage
    | ChatCompletionDeveloperMessage
    | ChatCompletionUserMessage
    | ChatCompletionAssistantMessage
    | ChatCompletionToolMessage,
    Field(discriminator="role"),
]


class FunctionDefinition(OpenModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionTool(OpenModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenModel):
    name: str


class NamedToolChoice(OpenModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")]
    | Annotated[NamedToolChoice, Tag("object")],
    by_shape("'none', 'auto', 'required' or a named function"),
]


class ChatReasoningSettings(OpenModel):
    effort: ReasoningEffort | None = None
    max_tokens: Annotated[StrictInt, Field(gt=0)] | None = None
    enabled: StrictBool | None = None
    exclude: StrictBool | None = None


class ChatRequest(GatewayRequest):
    model_config = ConfigDict(title="OpenAIChatCompletionsIn")

    messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(
        description=(
            "conversation messages: (user,assistant,tool)*,user including one system "
            "message anywhere"
        )
    )
    tools: list[FunctionTool] | None = Field(
        default=None,
        description="A list of tools the model may call. Currently, only functions are supported.",
    )
    tool_choice: ToolChoice | None = Field(
        default=None,
        description=(
            "Controls which (if any) function is called by the model: none, auto, required, "
            "or a named function the model must call."
        ),
    )
    logprobs: StrictBool | None = Field(
        default=None, description="Whether to return log probabilities of the output tokens."
    )
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = Field(
        default=None,
        description="Number of most likely tokens to return at each position, with logprobs.",
    )
    reasoning_effort: ReasoningEffort | None = Field(
        default=None,
        description=(
            "Constrains effort on reasoning for reasoning models. none disables reasoning "
            "entirely if the model supports it."
        ),
    )
    reasoning: ChatReasoningSettings | None = Field(
        default=None, description="Reasoning configuration."
    )
    cache_salt: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "Isolates this request's prefix cache: only requests with the same salt reuse "
            "each other's cached prefix."
        ),
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Chat template kwargs."
    )
    media_io_kwargs: dict[str, dict[str, Any]] | None = Field(
        default=None,
        description=(
            'Per-request media decode options keyed by modality, e.g. {"video": '
            '{"num_frames": 16}}.'
        ),
    )
    continue_final_message: StrictBool | None = Field(
        default=None,
        description=(
            "If set, the final assistant message is used as a prefix for the model to "
            "continue generating from, rather than starting a new turn."
        ),
    )

    def cache_key(self) -> tuple[str | None, str | None]:
        return self.prompt_cache_key, self.cache_salt
