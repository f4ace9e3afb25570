"""What a replica holds, and the ids in doubt it must forget (bounded)."""

from __future__ import annotations

import asyncio

from routing.admission.holdings import FORGET_ROUNDS, MAX_ORPHANS, Holdings, Lease, Waiter


def test_in_doubt_ids_are_forgotten_after_their_rounds() -> None:
    holdings = Holdings()
    holdings.doubt("l1", "m", None)
    holdings.doubt("l1", None, "gw:v2:acct:{a}")  # merged, not replaced
    models, accounts = holdings.orphans_by_model()
    assert (dict(models), dict(accounts)) == ({"m": ["l1"]}, {"gw:v2:acct:{a}": ["l1"]})
    for _ in range(FORGET_ROUNDS - 1):
        holdings.forgotten(["l1"])
        assert "l1" in holdings.orphans
    holdings.forgotten(["l1"])
    assert holdings.orphans == {}


def test_in_doubt_ids_are_bounded_in_number_and_age() -> None:
    holdings = Holdings()
    for i in range(MAX_ORPHANS + 5):
        holdings.doubt(f"l{i}", "m", None)
    assert len(holdings.orphans) == MAX_ORPHANS
    assert "l0" not in holdings.orphans and f"l{MAX_ORPHANS + 4}" in holdings.orphans
    newest = holdings.orphans[f"l{MAX_ORPHANS + 4}"].since
    holdings.prune(60.0, now=newest + 61.0)
    assert holdings.orphans == {}


async def test_what_the_sweep_sends_back() -> None:
    holdings = Holdings()
    holdings.held["l1"] = Lease("l1", "m", "http://a", "gw:v2:acct:{a}", 0.0)
    holdings.held["local"] = Lease("local", "m", "", "gw:v2:acct:{a}", 0.0, local=True)
    loop = asyncio.get_running_loop()
    holdings.waiters["w1"] = Waiter("m", loop.create_future(), place=10**15 + 3)
    holdings.waiters["w2"] = Waiter("m", loop.create_future())  # not confirmed queued yet
    woken = Waiter("m", loop.create_future(), place=10**15 + 4)
    woken.future.set_result("http://a")
    holdings.waiters["w3"] = woken
    holdings.walking["w1"] = "gw:v2:acct:{b}"
    assert holdings.leases_by_model() == {"m": [("l1", "http://a")]}
    assert holdings.waiters_by_model() == {"m": [("w1", 10**15 + 3)]}
    assert holdings.entries_by_account() == {"gw:v2:acct:{a}": ["l1"], "gw:v2:acct:{b}": ["w1"]}
    assert holdings.is_live("l1") and holdings.is_live("w1") and not holdings.is_live("w3")
    assert holdings.holding("m") == 2


def test_accounts_seen_lately_are_kept_oldest_first_and_forgotten_past_the_horizon() -> None:
    """A walk's start and a release stamp their account (moved to the end when seen again);
    `forget_seen` drops from the front those seen before the horizon, the rest stay."""
    holdings = Holdings()
    holdings.begin(0, "r-0~1~x", "gw:v2:acct:{a}")
    holdings.begin(1, "r-1~1~x", "gw:v2:acct:{b}")
    holdings.seen["gw:v2:acct:{a}"] -= 100.0  # (seen long ago)
    holdings.seen["gw:v2:acct:{b}"] -= 100.0
    lease = Lease("r-0~1~x", "m", "http://w:8000", "gw:v2:acct:{a}", 0.0)
    holdings.released(lease)  # a again, now: to the end
    assert list(holdings.seen) == ["gw:v2:acct:{b}", "gw:v2:acct:{a}"]
    holdings.forget_seen(50.0)
    assert list(holdings.seen) == ["gw:v2:acct:{a}"] and holdings.issued == 1
    assert holdings.end("r-0~1~x") is None and list(holdings.walks) == ["r-1~1~x"]
