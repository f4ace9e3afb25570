"""Service tiers: the names, their admission policy and their price multipliers.

The defaults are the contract of docs/api.md: priority and default may fill the whole
model, flex only its spare 20 %, and each tier has its own queue timeout and price factor.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Tier(StrEnum):
    PRIORITY = "priority"
    DEFAULT = "default"
    FLEX = "flex"

    @property
    def rank(self) -> int:
        """Queue order: lower ranks are served first."""
        return _RANKS[self]


_RANKS = {Tier.PRIORITY: 0, Tier.DEFAULT: 1, Tier.FLEX: 2}


class TierPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_utilization: float = Field(1.0, gt=0.0, le=1.0)
    queue_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    price_multiplier: float = Field(1.0, ge=0.0, le=100.0)


_DEFAULTS: dict[str, dict[str, float]] = {
    "priority": {"max_utilization": 1.0, "queue_timeout_s": 60.0, "price_multiplier": 1.5},
    "default": {"max_utilization": 1.0, "queue_timeout_s": 30.0, "price_multiplier": 1.0},
    "flex": {"max_utilization": 0.8, "queue_timeout_s": 10.0, "price_multiplier": 0.5},
}


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

    def policy(self, tier: Tier) -> TierPolicy:
        policy: TierPolicy = getattr(self, tier.value)
        return policy
