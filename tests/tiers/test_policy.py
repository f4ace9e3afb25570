"""Tier names, queue order and the per-tier policy lookup."""

from __future__ import annotations

import re
from pathlib import Path

import pydantic
import pytest

from tiers.policy import BY_RANK, TIERS, Tier, TierPolicy, TiersConfig


def test_queue_order_is_priority_default_flex() -> None:
    """The contract's order (docs/api.md), not the enum's declaration order restated."""
    assert (Tier("priority"), Tier("default"), Tier("flex")) == BY_RANK


def test_body_and_header_values_name_the_tiers() -> None:
    assert {Tier(name) for name in ("priority", "default", "flex")} == set(Tier)
    with pytest.raises(ValueError):
        Tier("auto")  # an alias of the body field, resolved in tiers/resolve.py


def test_policy_returns_each_tiers_own_policy() -> None:
    cfg = TiersConfig(
        priority=TierPolicy(queue_timeout_s=1),
        default=TierPolicy(queue_timeout_s=2),
        flex=TierPolicy(queue_timeout_s=3),
    )
    assert [cfg.policy(t).queue_timeout_s for t in Tier] == [1.0, 2.0, 3.0]
    assert cfg.policy(Tier.FLEX) is cfg.flex


def test_default_policies() -> None:
    cfg = TiersConfig()
    assert cfg.policy(Tier.PRIORITY) == TierPolicy(
        max_utilization=1.0, queue_timeout_s=60, price_multiplier=1.5, may_preempt=True
    )
    assert cfg.policy(Tier.DEFAULT) == TierPolicy(
        max_utilization=1.0, queue_timeout_s=30, price_multiplier=1.0
    )
    assert cfg.policy(Tier.FLEX) == TierPolicy(
        max_utilization=0.8, queue_timeout_s=10, price_multiplier=0.5
    )
    assert cfg.flex.on_preempt == "reject"


@pytest.mark.parametrize(
    "fields",
    [
        {"max_utilization": 0},
        {"max_utilization": 1.01},
        {"queue_timeout_s": 0},
        {"queue_timeout_s": 3601},
        {"price_multiplier": -0.1},
        {"surprise": 1},
    ],
)
def test_policy_bounds(fields: dict[str, float]) -> None:
    with pytest.raises(pydantic.ValidationError):
        TierPolicy(**fields)


def test_free_tier_price_allowed() -> None:
    assert TierPolicy(price_multiplier=0).price_multiplier == 0.0


def test_policies_are_frozen() -> None:
    with pytest.raises(pydantic.ValidationError):
        TiersConfig().flex.max_utilization = 1.0  # type: ignore[misc]


def test_the_tier_table_is_whole_and_ordered() -> None:
    """Every tier has one row; ranks are 0..n-1 (the scripts' tier index); BY_RANK is the
    order of the scripts' per-tier arguments; the config's fields are the tiers."""
    assert set(TIERS) == set(Tier)
    assert sorted(spec.rank for spec in TIERS.values()) == list(range(len(Tier)))
    assert [TIERS[t].rank for t in BY_RANK] == list(range(len(Tier)))
    assert set(TiersConfig.model_fields) == {t.value for t in Tier}
    assert [t.worker_priority for t in BY_RANK] == sorted(t.worker_priority for t in Tier)


def test_worker_priority_is_vllms_lower_first() -> None:
    assert [t.worker_priority for t in (Tier.PRIORITY, Tier.DEFAULT, Tier.FLEX)] == [-1, 0, 1]


def documented_tiers() -> list[tuple[str, float, float, float]]:
    """docs/api.md's tier table in its order: (name, ceiling, queue timeout s, price)."""
    text = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    table = text.split("## Tiers", 1)[1].split("\n\n", 2)[1]
    rows = []
    for line in table.splitlines()[2:]:
        name, _served, ceiling, timeout, price = (c.strip() for c in line.strip("|").split("|"))
        rows.append((
            name.strip("`"),
            float(re.match(r"[\d.]+", ceiling)[0]) / 100,  # type: ignore[index]
            float(timeout.removesuffix(" s")),
            float(price.removeprefix("x ")),
        ))  # fmt: skip
    return rows


def test_the_tiers_and_their_defaults_are_the_documented_contract() -> None:
    """The code against docs/api.md's table, not against itself: the names, the order they
    are served in, and each tier's default ceiling, queue timeout and price."""
    rows = documented_tiers()
    assert [name for name, *_ in rows] == [t.value for t in BY_RANK]
    assert {name for name, *_ in rows} == set(Tier)
    for name, ceiling, timeout, price in rows:
        policy = TiersConfig().policy(Tier(name))
        got = (policy.max_utilization, policy.queue_timeout_s, policy.price_multiplier)
        assert got == (ceiling, timeout, price), name


def test_a_tier_configured_in_part_keeps_its_own_defaults_for_the_rest() -> None:
    """flex given only a timeout stays flex (80 %, x 0.5), not TierPolicy's generic 100 %."""
    cfg = TiersConfig.model_validate({"flex": {"queue_timeout_s": 5}})
    assert cfg.flex == TierPolicy(max_utilization=0.8, queue_timeout_s=5, price_multiplier=0.5)
    assert cfg.priority == TiersConfig().priority  # the others untouched


def test_rank_is_the_place_in_the_queue_order() -> None:
    assert [t.rank for t in BY_RANK] == [0, 1, 2]
    assert min(Tier, key=lambda t: t.rank) is Tier.PRIORITY
    assert max(Tier, key=lambda t: t.rank) is Tier.FLEX


def test_flex_may_not_preempt() -> None:
    # Flex only takes spare capacity: `may_preempt: true` on it would be ignored, silently.
    with pytest.raises(pydantic.ValidationError, match="flex never preempts"):
        TiersConfig.model_validate({"flex": {"may_preempt": True}})
    assert TiersConfig.model_validate({"default": {"may_preempt": True}}).default.may_preempt
