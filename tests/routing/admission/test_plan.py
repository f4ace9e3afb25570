"""The fallback plan (docs/api.md): order, duplicates, unknown names, who may wait."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import pytest

from gateway.errors import from_routing
from routing.admission.plan import Candidate, plan_candidates
from routing.errors import UnknownModel
from routing.registry import ModelConfig, Registry
from tiers.policy import Tier


def registry(*names: str) -> Registry:
    cfg = ModelConfig.model_validate({"endpoints": [{"url": "http://w:1", "max_concurrency": 1}]})
    return Registry(dict.fromkeys(names, cfg))


REGISTRY = registry("a", "b", "c", "d")


def plan(
    requested: str = "a",
    fallbacks: Sequence[str] | None = None,
    *,
    fail_fast: bool = False,
    allowed: Collection[str] | None = None,
) -> list[Candidate]:
    return plan_candidates(
        requested, fallbacks, fail_fast=fail_fast, registry=REGISTRY, allowed=allowed
    )


def shape(candidates: list[Candidate]) -> list[tuple[str, int, bool]]:
    return [(c.model.name, c.index, c.may_wait) for c in candidates]


def test_no_models_list_plans_the_requested_model() -> None:
    assert shape(plan("b")) == [("b", 0, True)]


def test_empty_models_list_plans_the_requested_model() -> None:
    assert shape(plan("b", [])) == [("b", 0, True)]


def test_models_list_replaces_model() -> None:
    assert shape(plan("a", ["c", "b"])) == [("c", 0, False), ("b", 1, True)]


def test_duplicates_dropped_first_kept() -> None:
    assert shape(plan("a", ["b", "c", "b", "a", "c"])) == [
        ("b", 0, False),
        ("c", 1, False),
        ("a", 2, True),
    ]


def test_unknown_names_skipped_index_is_list_position() -> None:
    assert shape(plan("a", ["nope", "b", "nope", "gone", "c"])) == [
        ("b", 1, False),
        ("c", 3, True),
    ]


def test_unknown_last_entry_lets_the_last_known_wait() -> None:
    assert shape(plan("a", ["b", "c", "nope"])) == [("b", 0, False), ("c", 1, True)]


def test_fail_fast_means_nobody_waits() -> None:
    assert shape(plan("a", ["b", "c"], fail_fast=True)) == [("b", 0, False), ("c", 1, False)]
    assert shape(plan("a", fail_fast=True)) == [("a", 0, False)]


def test_only_last_candidate_may_wait() -> None:
    candidates = plan("a", ["a", "b", "c", "d"])
    assert [c.may_wait for c in candidates] == [False, False, False, True]


@pytest.mark.parametrize(
    ("requested", "fallbacks"), [("nope", None), ("a", ["x", "y"]), ("x", ["y", "y"])]
)
def test_all_unknown_is_model_not_found(requested: str, fallbacks: list[str] | None) -> None:
    with pytest.raises(UnknownModel) as info:
        plan(requested, fallbacks)
    assert from_routing(info.value).status == 404
    assert from_routing(info.value).code == "model_not_found"
    assert repr((fallbacks or [requested])[0]) in info.value.message


def test_not_found_message_is_bounded() -> None:
    with pytest.raises(UnknownModel) as info:
        plan("x" * 10_000)
    assert len(info.value.message) < 400


def test_allowed_restricts() -> None:
    assert shape(plan("a", ["a", "b", "c"], allowed={"b"})) == [("b", 1, True)]
    assert shape(plan("a", ["a", "b", "c"], allowed={"a", "c"})) == [
        ("a", 0, False),
        ("c", 2, True),
    ]


def test_nothing_allowed_is_model_not_found() -> None:
    with pytest.raises(UnknownModel):
        plan("a", allowed=set())
    with pytest.raises(UnknownModel):
        plan("a", ["a", "b"], allowed={"c"})


def test_candidates_carry_registry_models() -> None:
    (candidate,) = plan("c")
    assert candidate.model is REGISTRY.get("c")


def test_each_candidate_carries_the_tier_it_applies() -> None:
    """The plan says which tier each model rides: asked for, if both model and key allow it
    (so admission never calls back up to resolve it)."""
    endpoints = [{"url": "http://w:1", "max_concurrency": 1}]
    both = {"endpoints": endpoints, "tiers": ["priority", "flex"]}
    tiers = Registry(
        {
            "both": ModelConfig.model_validate(both),
            "plain": ModelConfig.model_validate({"endpoints": endpoints}),
        }
    )

    def applied(wanted: Tier, key_tiers: Collection[Tier] | None) -> list[Tier]:
        made = plan_candidates(
            "both", ["both", "plain"], fail_fast=False, registry=tiers, allowed=None,
            wanted=wanted, allowed_tiers=key_tiers,
        )  # fmt: skip
        return [c.tier for c in made]

    assert applied(Tier.PRIORITY, None) == [Tier.PRIORITY, Tier.DEFAULT]
    assert applied(Tier.FLEX, [Tier.PRIORITY]) == [Tier.DEFAULT, Tier.DEFAULT]
    assert applied(Tier.DEFAULT, None) == [Tier.DEFAULT, Tier.DEFAULT]
