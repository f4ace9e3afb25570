"""Local outage shares (on_outage: local): they never add up to more than the capacity. And
the outage's mode, which a reload may change: it decides the answer to the next outage."""

from __future__ import annotations

import pytest

from routing.admission.holdings import Holdings
from routing.admission.outage import LocalShares, Outage
from routing.admission.plan import plan_candidates
from routing.errors import Limited, LimitReason, Unavailable, UnavailableReason
from routing.registry import ModelConfig, Registry
from tiers.policy import Tier, TiersConfig


def shares(capacity: int, fleet: list[str]) -> list[int]:
    out = []
    for me in fleet:
        local = LocalShares(me, TiersConfig())
        local.capacity["m"] = capacity
        local.saw(fleet)
        out.append(local.limit("m"))
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
        views.append(local.limit("m"))
    assert sum(views) == 4


def test_a_replica_that_never_saw_the_fleet_has_no_share() -> None:
    local = LocalShares("me", TiersConfig())
    local.capacity["m"] = 8
    assert local.limit("m") == 0
    assert local.replicas == 0
    assert not local.room("m", Tier.PRIORITY, 0)
    local.saw([])  # its own heartbeat at least
    assert local.limit("m") == 8


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


@pytest.mark.parametrize("held", [(0, 0), (2, 0), (0, 3), (1, 1), (3, 2), (4, 4)])
def test_slots_held_before_the_outage_count_and_the_free_ones_are_shared(
    held: tuple[int, int],
) -> None:
    """Item 12: replicas a and b held some of capacity 5 when Redis went away. Each may hold
    what it held plus its cut of what was free; together never more than the capacity
    (unless they already held more, in which case nobody admits more)."""
    fleet_inflight = sum(held)
    limits = []
    for me, mine in zip(("a", "b"), held, strict=True):
        local = LocalShares(me, TiersConfig())
        local.capacity["m"] = 5
        local.saw(["a", "b"])
        local.observe("m", fleet_inflight, mine)
        limits.append(local.limit("m"))
        assert local.limit("m") >= mine
    assert sum(limits) == max(5, fleet_inflight)


def test_admit_takes_the_first_candidate_with_room_and_says_why_not_about_the_last() -> None:
    one = {"endpoints": [{"url": "http://w:1", "max_concurrency": 1}]}
    registry = Registry({name: ModelConfig.model_validate(one) for name in ("a", "b")})
    local = LocalShares("r1", TiersConfig())
    local.capacity.update(a=1, b=1)
    local.saw(["r1"])
    holdings = Holdings()
    plan = plan_candidates("a", ["a", "b"], fail_fast=True, registry=registry, allowed=None)
    first = local.admit(plan, "l1", "acct", holdings)
    second = local.admit(plan, "l2", "acct", holdings)
    assert [(c.model.name, lease.model, lease.local) for c, lease in (first, second)] == [
        ("a", "a", True),
        ("b", "b", True),
    ]
    assert set(holdings.held) == {"l1", "l2"}
    with pytest.raises(Limited) as full:
        local.admit(plan, "l3", "acct", holdings)
    assert (full.value.reason, full.value.model) == (LimitReason.MODEL_BUSY, "b")
    local.capacity.update(b=0)
    holdings.held.clear()
    local.capacity.update(a=0)
    with pytest.raises(Unavailable) as none:
        local.admit(plan, "l4", "acct", holdings)
    assert (none.value.reason, none.value.model) == (UnavailableReason.NO_LOCAL_SHARE, "b")


def test_the_outage_answers_by_its_mode_of_the_moment() -> None:
    one = {"endpoints": [{"url": "http://w:1", "max_concurrency": 2}]}
    registry = Registry({"a": ModelConfig.model_validate(one)})
    local = LocalShares("r1", TiersConfig())
    local.capacity["a"] = 2
    local.saw(["r1"])
    outage = Outage("reject", local)
    plan = plan_candidates("a", None, fail_fast=False, registry=registry, allowed=None)
    holdings, lost = Holdings(), ConnectionError("Redis went away")
    with pytest.raises(Unavailable) as rejected:
        outage.admit(plan, "l1", "acct", holdings, lost)
    assert rejected.value.reason == UnavailableReason.STORE_UNREACHABLE
    assert rejected.value.__cause__ is lost
    outage.mode = "local"  # as a reload sets it
    cand, lease = outage.admit(plan, "l2", "acct", holdings, lost)
    assert (cand.model.name, lease.local, set(holdings.held)) == ("a", True, {"l2"})
    outage.mode = "reject"
    with pytest.raises(Unavailable):
        outage.admit(plan, "l3", "acct", holdings, lost)
    assert set(holdings.held) == {"l2"}
