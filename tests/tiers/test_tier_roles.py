"""A tier's roles are fields of its row in the tier table (tiers/policy.py `TIERS`): what
it gets when the model is busy, whether its requests may be preempted. No code names a
tier to know what it does, so a tier more is one row."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from routing.admission.layout import preempting
from routing.errors import LimitReason
from tiers.policy import TIERS, Tier, TiersConfig


def test_every_tiers_busy_reason_is_a_429_reason() -> None:
    assert {t: LimitReason(spec.busy_reason) for t, spec in TIERS.items()} == {
        Tier.PRIORITY: LimitReason.MODEL_BUSY,
        Tier.DEFAULT: LimitReason.MODEL_BUSY,
        Tier.FLEX: LimitReason.FLEX_NO_CAPACITY,
    }


def test_only_a_preemptible_tier_is_preempted_and_it_never_preempts() -> None:
    assert [t for t in Tier if t.preemptible] == [Tier.FLEX]
    everyone = TiersConfig.model_validate({t.value: {"may_preempt": True} for t in Tier
                                           if not t.preemptible})  # fmt: skip
    assert preempting(everyone) == {Tier.PRIORITY, Tier.DEFAULT}
    with pytest.raises(ValidationError, match=r"flex\.may_preempt: flex never preempts"):
        TiersConfig.model_validate({"flex": {"may_preempt": True}})
