"""Request fields shared by `/v1/completions` and `/v1/chat/completions`.

The gateway forwards the caller's original JSON dict to the worker, so these models exist to
reject bad bodies with a 422 (and to document the API in /openapi.json), never to rewrite
them. Numbers and booleans are strict: a JSON string such as ``"0.5"`` or ``"true"``, or a
``1`` for a boolean, is refused rather than coerced, because the worker would see what was
sent, not the coerced value.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    Tag,
)
from pydantic_core import PydanticCustomError

from tiers.resolve import BODY_ALIASES

# An immutable compiled pattern, not state: any ':' or '@' marks a deploy_id:, :revision or
# host:port specifier, which the fallback list must not carry (docs/api.md).
_MODEL_NAME_FORBIDDEN = re.compile(r"[\s:@]")
_MODEL_NAME_PATTERN = r"^[^\s:@]+$"


class OpenModel(BaseModel):
    """Base of every nested object: unknown keys are kept, since workers may know them."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


def _check_plain_model_name(name: str) -> str:
    if _MODEL_NAME_FORBIDDEN.search(name):
        raise PydanticCustomError(
            "model_name",
            "Entries must be plain model names (no deploy_id:, :revision, host:port, '@' "
            "or whitespace)",
        )
    return name


PlainModelName = Annotated[
    str,
    Field(min_length=1, max_length=256, json_schema_extra={"pattern": _MODEL_NAME_PATTERN}),
    AfterValidator(_check_plain_model_name),
]


def json_shape(value: Any) -> str | None:
    """Tag a value by its JSON shape, to discriminate `str | list | object` unions.

    A plain union reports a failure once per member ("not a string", then the real list
    error); tagging by shape reports only the error of the member the caller meant.
    """
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict | BaseModel):
        return "object"
    return None


def by_shape(expected: str) -> Discriminator:
    return Discriminator(
        json_shape,
        custom_error_type="shape_error",
        custom_error_message=f"Input should be {expected}",
    )


# The body's `service_tier` values come from the tier package (the tiers and their aliases),
# so a new tier needs no edit here; the same Literal for pydantic's message and schema.
if TYPE_CHECKING:
    ServiceTier = str
else:
    ServiceTier = Literal[tuple(BODY_ALIASES)]

TokenId = StrictInt

# Token limits, penalties and samplers carry the seed's bounds; see OpenAICompletionsIn.
MaxTokens = Annotated[StrictInt, Field(gt=0, le=10_000_000)]
# `le=2**64 - 1`, the seed's `< 2**64`, because 2**64 itself does not fit orjson's integers
# and would break rendering /openapi.json.
Seed = Annotated[StrictInt, Field(ge=-(2**63), le=2**64 - 1)]
Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0)]
Stop = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[str], Field(max_length=16), Tag("list")],
    by_shape("a string or a list of at most 16 strings"),
]
StopTokenIds = Annotated[list[TokenId], Field(max_length=16)]


class StreamOptions(OpenModel):
    include_usage: StrictBool = Field(default=True, description="whether to include usage data")
    continuous_usage_stats: StrictBool = Field(
        default=False,
        description="whether to include usage stats continuously with each streaming event",
    )


class PromptCacheOptions(OpenModel):
    mode: Literal["explicit", "implicit"] | None = Field(
        default=None, description="Prompt caching mode; 'explicit' requests explicit caching."
    )
    ttl: Literal["5m", "1h"] | None = Field(
        default=None, description="Requested cache retention for this request's prefix."
    )


class TextResponseFormat(OpenModel):
    type: Literal["text"]


class JsonObjectResponseFormat(OpenModel):
    type: Literal["json_object"]


class JsonSchema(OpenModel):
    name: str = Field(description="Name identifier for the JSON schema")
    # Aliased because a field called `schema` shadows BaseModel.schema (a warning at import).
    schema_: dict[str, Any] = Field(
        alias="schema", title="Schema", description="The actual JSON schema definition"
    )
    description: str | None = None
    strict: StrictBool | None = None


class JsonSchemaResponseFormat(OpenModel):
    type: Literal["json_schema"]
    json_schema: JsonSchema = Field(
        description="JSON schema for structured output when type is 'json_schema'"
    )


class RegexResponseFormat(OpenModel):
    type: Literal["regex"]
    regex: str = Field(description="Regex pattern for structured output when type is 'regex'")


ResponseFormat = Annotated[
    TextResponseFormat | JsonObjectResponseFormat | JsonSchemaResponseFormat | RegexResponseFormat,
    Field(discriminator="type"),
]


class RoutedRequest(BaseModel):
    """What every route the gateway admits and forwards accepts: its gateway-only fields and
    the model. Unknown fields are kept: they are forwarded, workers may know them."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    # Gateway-only fields: consumed by the gateway, never forwarded.
    service_tier: ServiceTier | None = Field(
        default=None,
        description=(
            "The service tier used for processing the request. 'priority' processes the "
            "request with higher priority (premium rate); 'flex' processes it at lower "
            "priority for a discount, served only when spare capacity exists. For "
            "compatibility, 'auto' is treated as 'priority' and 'standard_only' as 'default'."
        ),
    )
    fail_fast: StrictBool = Field(
        default=False,
        description=(
            "If true, the request is rejected immediately with HTTP 429 when the model has "
            "no spare capacity, instead of waiting in the queue."
        ),
    )
    models: Annotated[list[PlainModelName], Field(min_length=1, max_length=4)] | None = Field(
        default=None,
        description=(
            "Ordered list of up to 4 fallback models, tried in order when a model has no "
            "capacity. When set, the model field is ignored. Entries must be plain model "
            "names (no deploy_id:, custom_hostport, or :revision specifiers); duplicate "
            "entries are ignored, keeping the first occurrence."
        ),
    )

    model: str = Field(description="model name", examples=["meta-llama/Llama-2-70b-chat-hf"])

    def for_worker(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The caller's body as workers should see it; a route whose schema accepts a
        shape the seed does not (completions' one-string prompt list) rewrites it here."""
        return payload

    # What the walk reads of every route's body, each route saying it from its own fields.
    def streams(self) -> bool:
        return False

    def end_user(self) -> str | None:
        return None

    def cache_key(self) -> tuple[str | None, str | None]:
        """Its prefix-cache affinity: `prompt_cache_key`, and chat's `cache_salt`."""
        return None, None


class GeneratingRequest(RoutedRequest):
    """A request for generated text (completions, chat, responses): it may stream, names its
    end-user and may ask for a worker whose prefix cache holds its prompt."""

    stream: StrictBool = Field(
        default=False,
        description="whether to stream the output via SSE or return the full response",
    )
    user: str | None = Field(
        default=None, description="A unique identifier representing your end-user."
    )
    prompt_cache_key: str | None = Field(
        default=None,
        description="A key to identify prompt cache for reuse across requests.",
    )

    def streams(self) -> bool:
        return self.stream

    def end_user(self) -> str | None:
        return self.user

    def cache_key(self) -> tuple[str | None, str | None]:
        return self.prompt_cache_key, None


class GatewayRequest(GeneratingRequest):
    """Fields both completion routes accept; each adds its own input (prompt, messages)."""

    max_tokens: MaxTokens | None = Field(
        default=None,
        description=(
            "The maximum number of tokens to generate. If None it will be the model's max "
            "context length minus input length or 65536, whichever is smaller."
        ),
    )
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=2.0)] = Field(
        default=1.0, description="What sampling temperature to use, between 0 and 2."
    )
    top_p: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] = Field(
        default=1.0,
        description="Nucleus sampling: only the tokens comprising the top_p probability mass.",
    )
    min_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] = Field(
        default=0.0,
        description=(
            "Minimum probability for a token to be considered, relative to the most likely "
            "token. Must be in [0, 1]. Set to 0 to disable this."
        ),
    )
    top_k: Annotated[StrictInt, Field(ge=0, lt=1000)] = Field(
        default=0, description="Sample from the best k (number of) tokens. 0 means off"
    )
    n: Annotated[StrictInt, Field(ge=1, le=4)] = Field(
        default=1, description="number of sequences to return"
    )
    stream_options: StreamOptions | None = Field(default=None, description="streaming options")
    echo: StrictBool | None = Field(
        default=None, description="return prompt as part of the response"
    )
    stop: Stop | None = Field(
        default=None,
        description="up to 16 sequences where the API will stop generating further tokens",
    )
    stop_token_ids: StopTokenIds | None = Field(
        default=None,
        description=(
            "Up to 16 token IDs where the API will stop generating further tokens. Merged "
            "with the model's built-in stop tokens."
        ),
    )
    presence_penalty: Penalty = Field(
        default=0.0,
        description="Positive values penalize new tokens based on whether they appear so far.",
    )
    frequency_penalty: Penalty = Field(
        default=0.0,
        description="Positive values penalize new tokens based on how often they appear so far.",
    )
    response_format: ResponseFormat | None = Field(
        default=None, description="The format of the response."
    )
    repetition_penalty: Annotated[StrictFloat, Field(ge=0.01, le=5.0)] = Field(
        default=1.0,
        description=(
            "Alternative penalty for repetition, but multiplicative instead of additive "
            "(> 1 penalize, < 1 encourage)"
        ),
    )
    seed: Seed | None = Field(
        default=None,
        description="Seed for random number generator. If not provided, a random seed is used.",
    )
    return_tokens_as_token_ids: StrictBool | None = Field(
        default=None, description="return tokens as token ids"
    )
    prompt_cache_options: PromptCacheOptions | None = Field(
        default=None,
        description='Prompt cache options for this request\'s prefix, e.g. {"ttl": "1h"}.',
    )
    ignore_eos: StrictBool | None = Field(
        default=None,
        description=(
            "Keep generating until max_tokens instead of stopping at the end-of-sequence "
            "token. Intended for benchmarking."
        ),
    )
