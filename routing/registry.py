"""The fleet as configured: models, their endpoints, tiers and prices.

These are the config schema's model/endpoint sections (validated at start and on reload)
plus the lookups the request path needs. Capacity here is the configured one; admission
counts only the endpoints health keeps in rotation (routing/hop/health.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    HttpUrl,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tiers.policy import Tier

# Model names travel in URLs, Redis keys and metric labels: keep them plain.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/\-]{0,255}$"


def _not_bool(value: Any) -> Any:
    """YAML's true/yes/on are booleans, which pydantic would take as the number 1: a count
    or limit given one (`rpm: yes`) was meant otherwise, never as 1."""
    if isinstance(value, bool):
        raise PydanticCustomError("not_bool", "must be a number, not true or false")
    return value


# A number of the config, never a boolean (strings still convert: `${ENV}` expands to one).
NotBool = BeforeValidator(_not_bool)
MAX_TOKEN_BUDGET = 1_000_000_000


def _token_budget(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """`max_tokens_in_flight`: one message naming both forms, not one per form of the union."""
    try:
        return handler(_not_bool(value))
    except (ValidationError, PydanticCustomError):
        raise PydanticCustomError(
            "token_budget",
            f"must be a whole number of tokens from 1 to {MAX_TOKEN_BUDGET}, or auto",
        ) from None


TokenBudget = Annotated[
    Annotated[int, Field(ge=1, le=MAX_TOKEN_BUDGET)] | Literal["auto"],
    WrapValidator(_token_budget),
]


class EndpointConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: HttpUrl
    max_concurrency: Annotated[int, NotBool] = Field(ge=1, le=100_000)
    # The name the worker serves the model under (vLLM --served-model-name); default: ours.
    model: str | None = Field(None, min_length=1, max_length=256)
    # Credentials for the worker itself (vLLM --api-key); never the caller's key.
    api_key: str | None = Field(None, repr=False)
    # Read the worker's /metrics (vLLM's queue and KV-cache gauges) to prefer idle workers.
    metrics: bool = False
    # The worker's KV cache in tokens: admission holds the requests' reservations (prompt
    # estimate + output cap) on it to this; `auto`: read from the worker's /metrics
    # (vLLM's `vllm:cache_config_info`, num_gpu_blocks x block_size). Absent: no budget.
    max_tokens_in_flight: TokenBudget | None = None

    @field_validator("api_key")
    @classmethod
    def _empty_is_none(cls, key: str | None) -> str | None:
        # `${WORKER_API_KEY:-}` expands to "" when unset: that means no key.
        return key or None

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")


class AdaptiveConfig(BaseModel):
    """An endpoint's token budget shrinks when its worker says it is overfull (requests
    waiting, or its KV cache above `kv_threshold`) and grows back while it is not
    (multiplicative decrease, additive increase), never below `min_fraction` of it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    min_fraction: Annotated[float, NotBool] = Field(0.5, gt=0.0, le=1.0)
    waiting_threshold: Annotated[int, NotBool] = Field(1, ge=1, le=1_000_000)
    kv_threshold: Annotated[float, NotBool] = Field(0.95, gt=0.0, le=1.0)


class PriceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    input_per_mtok: float = Field(0.0, ge=0.0)
    output_per_mtok: float = Field(0.0, ge=0.0)


# The routes a model's workers may serve (`models.<m>.serves`): the gateway forwards to them
# only those its config lists (the edge's table of routes: gateway/completions/apis.py).
Api = Literal["completions", "chat", "responses", "embeddings"]
DEFAULT_APIS: tuple[Api, ...] = ("completions", "chat")


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # A tier must be listed here to apply; `default` always applies.
    tiers: tuple[Tier, ...] = (Tier.DEFAULT,)
    # What its workers serve: vLLM serves the first three for a generating model, and
    # embeddings for a pooling one.
    serves: tuple[Api, ...] = Field(DEFAULT_APIS, min_length=1)
    max_queue: Annotated[int, NotBool] = Field(100, ge=0, le=1_000_000)
    price: PriceConfig = PriceConfig()
    worker_priority: bool = False
    endpoints: tuple[EndpointConfig, ...] = Field(min_length=1)
    # Hash tags the endpoints are split over (routing/admission/partitions.py): one hot
    # model's admissions spread over that many Redis Cluster masters.
    partitions: Annotated[int, NotBool] = Field(1, ge=1, le=64)
    # What a request that names no max_tokens reserves for its answer on a token budget;
    # also the most any request reserves for it (its max_tokens above this is not reserved).
    max_tokens_default: Annotated[int, NotBool] = Field(1024, ge=1, le=10_000_000)
    adaptive: AdaptiveConfig = AdaptiveConfig()

    @model_validator(mode="after")
    def _partitions_have_endpoints(self) -> ModelConfig:
        if self.partitions > len(self.endpoints):
            raise ValueError(
                f"partitions ({self.partitions}) must not exceed the number of endpoints "
                f"({len(self.endpoints)})"
            )
        return self

    @field_validator("endpoints")
    @classmethod
    def _distinct_urls(cls, endpoints: tuple[EndpointConfig, ...]) -> tuple[EndpointConfig, ...]:
        urls = [e.base_url for e in endpoints]
        if len(set(urls)) != len(urls):
            raise ValueError("endpoint urls must be distinct within a model")
        return endpoints


@dataclass(frozen=True, slots=True)
class Model:
    """One servable model: its name, policy and endpoints, in the shape the hot path reads."""

    name: str
    config: ModelConfig
    tiers: frozenset[Tier]

    @property
    def capacity(self) -> int:
        return sum(e.max_concurrency for e in self.config.endpoints)

    @property
    def token_budgets(self) -> bool:
        """Whether any of its endpoints holds requests to a token budget."""
        return any(e.max_tokens_in_flight is not None for e in self.config.endpoints)


class Registry:
    """Name -> Model lookups. Immutable; a config reload builds a new one."""

    def __init__(self, models: Mapping[str, ModelConfig]) -> None:
        self._models = {
            name: Model(name, cfg, frozenset(cfg.tiers) | {Tier.DEFAULT})
            for name, cfg in models.items()
        }

    def get(self, name: str) -> Model | None:
        return self._models.get(name)

    def __iter__(self) -> Iterator[Model]:
        return iter(self._models.values())

    def names(self) -> list[str]:
        return list(self._models)
