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

    @property
    def preemptible(self) -> bool:
        """Its requests that have not started may lose their slot to a tier that may
        preempt (`TierSpec.preemptible`)."""
        return TIERS[self].preemptible

    @property
    def busy_reason(self) -> str:
        """The 429 reason it gets when the model has no room for it (routing/errors.py
        `LimitReason`, by value)."""
        return TIERS[self].busy_reason


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
    # Its requests that have not started may lose their slot to a tier that may preempt
    # (it takes spare capacity only, so it never preempts itself: `may_preempt` refused);
    # preempted, it gets a 429 or its place back at the head of its queue (`on_preempt`).
    preemptible: bool = False
    # The 429 reason when the model has no room for it (a value of routing/errors.py
    # `LimitReason`: tests/tiers pin that each is one).
    busy_reason: str = "model_busy"

    def defaults(self) -> dict[str, float | bool]:
        return {
            "max_utilization": self.max_utilization,
            "queue_timeout_s": self.queue_timeout_s,
            "price_multiplier": self.price_multiplier,
            "may_preempt": self.may_preempt,
        }


# The tier table: adding a tier is a row here, a member of Tier and a field of TiersConfig
# (docs/how-to.md). Its roles (preemptible, its busy reason) are fields of its row: no code
# names a tier to know what it does.
TIERS: dict[Tier, TierSpec] = {
    Tier.PRIORITY: TierSpec(
        0, -1, max_utilization=1.0, queue_timeout_s=60.0, price_multiplier=1.5, may_preempt=True
    ),
    Tier.DEFAULT: TierSpec(1, 0, max_utilization=1.0, queue_timeout_s=30.0, price_multiplier=1.0),
    Tier.FLEX: TierSpec(
        2,
        1,
        max_utilization=0.8,
        queue_timeout_s=10.0,
        price_multiplier=0.5,
        preemptible=True,
        busy_reason="flex_no_capacity",
    ),
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
    # What a request of a preemptible tier (flex) preempted so gets: a 429 `preempted`
    # (reject), or its place back at the head of its tier's queue (requeue). Read for the
    # preemptible tiers only.
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
    def _preemptible_never_preempts(self) -> TiersConfig:
        # A preemptible tier (flex) only takes spare capacity: a `may_preempt` there would be
        # ignored, silently.
        for tier in Tier:
            if tier.preemptible and self.policy(tier).may_preempt:
                why = f"{tier}.may_preempt: {tier} never preempts (it takes spare capacity only)"
                raise PydanticCustomError("flex_preempts", why)
        return self

    def policy(self, tier: Tier) -> TierPolicy:
        policy: TierPolicy = getattr(self, tier.value)
        return policy
