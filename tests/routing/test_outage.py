"""Local outage shares (SPEC 4, on_outage: local): they never add up to more than the capacity."""

from __future__ import annotations

import pytest

from routing.outage import LocalShares
from tiers.policy import Tier, TiersConfig


def shares(capacity: int, fleet: list[str]) -> list[int]:
    out = []
    for me in fleet:
        local = LocalShares(me, TiersConfig())
        local.capacity["m"] = capacity
        local.saw(fleet)
        out.append(local.share("m"))
    return out


@pytest.mark.parametrize("capacity", [0, 1, 2, 3, 7, 8, 64, 129])
@pytest.mark.parametrize("replicas", [1, 2, 3, 5, 16])
def test_shares_add_up_to_the_capacity_and_differ_by_at_most_one(
    capacity: int, replicas: int
) -> None:
    cut = shares(capacity, [f"r{i:02d}" for i in range(replicas)])
    assert sum(cut) == capacity
    assert max(cut) - min(cut) <= 1


def test_every_replica_cuts_the_same_way_whatever_order_it_saw() -> None:
    fleet = ["c", "a", "b"]
    views = []
    for me in fleet:
        local = LocalShares(me, TiersConfig())
        local.capacity["m"] = 4
        local.saw(list(reversed(fleet)) if me == "b" else fleet)
        views.append(local.share("m"))
    assert sum(views) == 4


def test_a_replica_that_never_saw_the_fleet_has_no_share() -> None:
    local = LocalShares("me", TiersConfig())
    local.capacity["m"] = 8
    assert local.share("m") == 0
    assert local.replicas == 0
    assert not local.room("m", Tier.PRIORITY, 0)
    local.saw([])  # its own heartbeat at least
    assert local.share("m") == 8


def test_room_counts_what_the_replica_holds_and_the_tier_ceiling() -> None:
    local = LocalShares("a", TiersConfig())
    local.capacity["m"] = 10
    local.saw(["a", "b"])  # 5 each
    assert local.room("m", Tier.DEFAULT, 4)
    assert not local.room("m", Tier.DEFAULT, 5)
    assert local.room("m", Tier.FLEX, 3)  # 5 x 0.8 = 4
    assert not local.room("m", Tier.FLEX, 4)


def test_the_tiers_follow_a_reload() -> None:
    local = LocalShares("a", TiersConfig())
    local.capacity["m"] = 10
    local.saw(["a"])
    assert local.room("m", Tier.FLEX, 7)
    local.tiers = TiersConfig.model_validate({"flex": {"max_utilization": 0.5}})
    assert not local.room("m", Tier.FLEX, 5)
