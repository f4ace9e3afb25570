"""Rendezvous order for prefix-cache affinity."""

from __future__ import annotations

from collections import Counter

from routing.admission.affinity import affinity_key, rendezvous

URLS = [f"http://w{i}:8000" for i in range(4)]


def test_order_is_stable_and_a_permutation() -> None:
    first = rendezvous("conversation-17", URLS)
    assert sorted(first) == sorted(URLS)
    assert rendezvous("conversation-17", list(reversed(URLS))) == first


def test_keys_spread_over_endpoints() -> None:
    favourites = Counter(rendezvous(f"key-{i}", URLS)[0] for i in range(400))
    assert set(favourites) == set(URLS)
    assert min(favourites.values()) > 50


def test_removing_an_endpoint_moves_only_its_keys() -> None:
    keys = [f"key-{i}" for i in range(200)]
    before = {k: rendezvous(k, URLS)[0] for k in keys}
    after = {k: rendezvous(k, URLS[1:])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == URLS[0] for k in moved)


def test_salt_separates_the_same_key() -> None:
    assert affinity_key(None, "s") is None
    assert affinity_key("k", None) == "k"
    assert affinity_key("k", "s") != affinity_key("k", None)


def test_odd_keys_hash_without_raising() -> None:
    # The edge refuses lone surrogates; hashing must not be what fails a request anyway.
    for key in ["\ud800", "a\udfffb", "\x00", "\U0001f600", ""]:
        assert sorted(rendezvous(key, URLS)) == sorted(URLS)
