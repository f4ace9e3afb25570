"""Service tiers: the names, their admission policy and their price multipliers.

The defaults are the contract of docs/api.md: priority and default may fill the whole
model, flex only its spare 20 %, and each tier has its own queue timeout and price factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError


class Tier(StrEnum):
    PRIORITY = "priority"
    DEFAULT = "default"
    FLEX = "flex"

    @property
    def rank(self) -> int:
        """Queue order: lower ranks are served first (the Redis scripts' tier index)."""
        return TIERS[self].rank

    @property
    def worker_priority(self) -> int:
        """vLLM's `priority` field for this tier (lower runs first), for models that ask."""
        return TIERS[self].worker_priority


@dataclass(frozen=True, slots=True)
class TierSpec:
    """What the contract fixes for a tier: its place in the queue, what it tells workers
    that schedule by priority, and the defaults of its config keys (`tiers.<name>`)."""

    rank: int
    worker_priority: int
    max_utilization: float
    queue_timeout_s: float
    price_multiplier: float
    may_preempt: bool = False

    def defaults(self) -> dict[str, float | bool]:
        return {
            "max_utilization": self.max_utilization,
            "queue_timeout_s": self.queue_timeout_s,
            "price_multiplier": self.price_multiplier,
            "may_preempt": self.may_preempt,
        }


# The tier table: adding a tier is a row here, a member of Tier and a field of TiersConfig.
TIERS: dict[Tier, TierSpec] = {
    Tier.PRIORITY: TierSpec(
        0, -1, max_utilization=1.0, queue_timeout_s=60.0, price_multiplier=1.5, may_preempt=True
    ),
    Tier.DEFAULT: TierSpec(1, 0, max_utilization=1.0, queue_timeout_s=30.0, price_multiplier=1.0),
    Tier.FLEX: TierSpec(2, 1, max_utilization=0.8, queue_timeout_s=10.0, price_multiplier=0.5),
}
# Tiers in queue order (the order of the scripts' per-tier arguments and replies).
BY_RANK: tuple[Tier, ...] = tuple(sorted(TIERS, key=lambda t: TIERS[t].rank))


class TierPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_utilization: float = Field(1.0, gt=0.0, le=1.0)
    queue_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    price_multiplier: float = Field(1.0, ge=0.0, le=100.0)
    # Who a freed slot goes to among this tier's waiters: the account with the fewest of the
    # model's slots per weight (then its oldest waiter), the fewest tokens reserved per
    # weight, or plain arrival order.
    fairness: Literal["accounts", "tokens", "fifo"] = "accounts"
    # A request of this tier that would queue takes the slot of a flex request that has not
    # sent its first byte yet (docs/api.md, preemption).
    may_preempt: bool = False
    # What a flex request preempted so gets: a 429 `preempted` (reject), or its place back
    # at the head of the flex queue (requeue). Read for flex only.
    on_preempt: Literal["reject", "requeue"] = "reject"


_DEFAULTS = {tier.value: spec.defaults() for tier, spec in TIERS.items()}


class TiersConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    priority: TierPolicy = TierPolicy(**_DEFAULTS["priority"])
    default: TierPolicy = TierPolicy(**_DEFAULTS["default"])
    flex: TierPolicy = TierPolicy(**_DEFAULTS["flex"])

    @model_validator(mode="before")
    @classmethod
    def _per_tier_defaults(cls, data: Any) -> Any:
        """A key set for one tier keeps that tier's own defaults for the others."""
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name, defaults in _DEFAULTS.items():
            given = data.get(name)
            if isinstance(given, dict):
                merged[name] = {**defaults, **given}
        return merged

    @model_validator(mode="after")
    def _flex_never_preempts(self) -> TiersConfig:
        # Flex only takes spare capacity: a flex that may preempt would be ignored, silently.
        if self.flex.may_preempt:
            why = "flex.may_preempt: flex never preempts (it takes spare capacity only)"
            raise PydanticCustomError("flex_preempts", why)
        return self

    def policy(self, tier: Tier) -> TierPolicy:
        policy: TierPolicy = getattr(self, tier.value)
        return policy
