"""Which tier a request rides (docs/api.md).

Precedence: the body's `service_tier` (already validated, aliases allowed), then the
`x-deepinfra-service-tier` header (junk rides default), then default. A tier the model does
not list, or the key may not use, falls back to default; the caller is told the applied tier.
"""

from __future__ import annotations

from collections.abc import Collection

from tiers.policy import Tier

BODY_ALIASES: dict[str, Tier] = {
    "default": Tier.DEFAULT,
    "priority": Tier.PRIORITY,
    "flex": Tier.FLEX,
    "auto": Tier.PRIORITY,
    "standard_only": Tier.DEFAULT,
}
_HEADER_VALUES: dict[str, Tier] = {t.value: t for t in Tier}


def requested_tier(body_value: str | None, header_value: str | None) -> Tier:
    """The tier the caller asked for, before model and key policy apply."""
    if body_value is not None:
        # The schema admits only BODY_ALIASES keys; anything else never reaches here.
        return BODY_ALIASES[body_value]
    if header_value:
        return _HEADER_VALUES.get(header_value.strip().lower(), Tier.DEFAULT)
    return Tier.DEFAULT


def applied_tier(
    requested: Tier,
    model_tiers: Collection[Tier],
    key_tiers: Collection[Tier] | None,
) -> Tier:
    """The tier actually applied on one model: default unless both model and key allow it."""
    if requested is Tier.DEFAULT:
        return Tier.DEFAULT
    if requested not in model_tiers:
        return Tier.DEFAULT
    if key_tiers is not None and requested not in key_tiers:
        return Tier.DEFAULT
    return requested
