"""Tier resolution (docs/api.md): body beats header beats default; model and key may veto."""

from __future__ import annotations

import pytest

from tiers.policy import Tier
from tiers.resolve import BODY_ALIASES, applied_tier, requested_tier

ALL = frozenset(Tier)


@pytest.mark.parametrize(
    ("body", "header", "expected"),
    [
        (None, None, Tier.DEFAULT),
        ("priority", None, Tier.PRIORITY),
        ("flex", None, Tier.FLEX),
        ("default", None, Tier.DEFAULT),
        ("auto", None, Tier.PRIORITY),
        ("standard_only", None, Tier.DEFAULT),
        (None, "priority", Tier.PRIORITY),
        (None, "flex", Tier.FLEX),
        (None, "default", Tier.DEFAULT),
        # the body wins over the header, whatever each says
        ("flex", "priority", Tier.FLEX),
        ("default", "priority", Tier.DEFAULT),
        ("standard_only", "flex", Tier.DEFAULT),
        ("auto", "flex", Tier.PRIORITY),
        # header values are case-insensitive and trimmed
        (None, "PRIORITY", Tier.PRIORITY),
        (None, "Flex", Tier.FLEX),
        (None, "  flex ", Tier.FLEX),
        # junk headers ride default; body aliases are not header values
        (None, "gold", Tier.DEFAULT),
        (None, "auto", Tier.DEFAULT),
        (None, "standard_only", Tier.DEFAULT),
        (None, "", Tier.DEFAULT),
        (None, "   ", Tier.DEFAULT),
        (None, "priority,flex", Tier.DEFAULT),
    ],
)
def test_requested_tier(body: str | None, header: str | None, expected: Tier) -> None:
    assert requested_tier(body, header) is expected


def test_body_aliases_are_the_schema_values() -> None:
    assert set(BODY_ALIASES) == {"default", "priority", "flex", "auto", "standard_only"}


@pytest.mark.parametrize("tier", list(Tier))
def test_tier_applies_when_model_and_key_allow_it(tier: Tier) -> None:
    assert applied_tier(tier, ALL, None) is tier
    assert applied_tier(tier, ALL, ALL) is tier


@pytest.mark.parametrize("tier", [Tier.PRIORITY, Tier.FLEX])
def test_model_without_the_tier_rides_default(tier: Tier) -> None:
    assert applied_tier(tier, {Tier.DEFAULT}, None) is Tier.DEFAULT
    other = Tier.FLEX if tier is Tier.PRIORITY else Tier.PRIORITY
    assert applied_tier(tier, {Tier.DEFAULT, other}, None) is Tier.DEFAULT


@pytest.mark.parametrize("tier", [Tier.PRIORITY, Tier.FLEX])
def test_key_without_the_tier_rides_default(tier: Tier) -> None:
    assert applied_tier(tier, ALL, {Tier.DEFAULT}) is Tier.DEFAULT
    assert applied_tier(tier, ALL, frozenset()) is Tier.DEFAULT


def test_default_always_applies() -> None:
    assert applied_tier(Tier.DEFAULT, set(), frozenset()) is Tier.DEFAULT


def test_key_allowing_a_tier_the_model_lacks_still_rides_default() -> None:
    assert applied_tier(Tier.PRIORITY, {Tier.DEFAULT, Tier.FLEX}, ALL) is Tier.DEFAULT


@pytest.mark.parametrize(
    ("body", "header", "model_tiers", "key_tiers", "expected"),
    [
        ("auto", None, ALL, None, Tier.PRIORITY),
        ("auto", None, {Tier.DEFAULT, Tier.FLEX}, None, Tier.DEFAULT),
        (None, "FLEX", ALL, {Tier.FLEX}, Tier.FLEX),
        (None, "flex", ALL, {Tier.PRIORITY}, Tier.DEFAULT),
        ("standard_only", "priority", ALL, None, Tier.DEFAULT),
    ],
)
def test_requested_then_applied(
    body: str | None,
    header: str | None,
    model_tiers: frozenset[Tier],
    key_tiers: frozenset[Tier] | None,
    expected: Tier,
) -> None:
    assert applied_tier(requested_tier(body, header), model_tiers, key_tiers) is expected
