"""The hash ring of prefix-cache affinity."""

from __future__ import annotations

from collections import Counter

from routing.choice.affinity import Ring, affinity_key

URLS = [f"http://w{i}:8000" for i in range(4)]


def test_order_is_stable_and_distinct() -> None:
    first = Ring(URLS).preferred("conversation-17", 4)
    assert sorted(first) == sorted(URLS)
    assert Ring(list(reversed(URLS))).preferred("conversation-17", 4) == first
    assert Ring(URLS).preferred("conversation-17", 2) == first[:2]


def test_fewer_endpoints_than_asked_for() -> None:
    assert Ring(URLS[:1]).preferred("k", 4) == URLS[:1]
    assert Ring([]).preferred("k", 4) == []


def test_keys_spread_over_endpoints() -> None:
    ring = Ring(URLS)
    favourites = Counter(ring.preferred(f"key-{i}", 1)[0] for i in range(400))
    assert set(favourites) == set(URLS)
    assert min(favourites.values()) > 50


def test_keys_spread_over_a_thousand_endpoints() -> None:
    urls = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(1000)]
    ring = Ring(urls)
    favourites = Counter(ring.preferred(f"key-{i}", 1)[0] for i in range(20_000))
    # 20 keys each on average: none gets a tenth of them, most get some.
    assert max(favourites.values()) < 2000 and len(favourites) > 900


def test_removing_an_endpoint_moves_only_its_keys() -> None:
    keys = [f"key-{i}" for i in range(200)]
    before = {k: Ring(URLS).preferred(k, 1)[0] for k in keys}
    after = {k: Ring(URLS[1:]).preferred(k, 1)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == URLS[0] for k in moved)


def test_salt_separates_the_same_key() -> None:
    assert affinity_key(None, "s") is None
    assert affinity_key("k", None) == "k"
    assert affinity_key("k", "s") != affinity_key("k", None)


def test_odd_keys_hash_without_raising() -> None:
    # The edge refuses lone surrogates; hashing must not be what fails a request anyway.
    for key in ["\ud800", "a\udfffb", "\x00", "\U0001f600", ""]:
        assert sorted(Ring(URLS).preferred(key, 4)) == sorted(URLS)


def test_a_ring_changed_in_place_is_the_ring_built_afresh() -> None:
    """Health changes the set an endpoint at a time: the ring made from the last one (points
    kept, dropped, inserted, or many sorted in) answers as one built from nothing."""
    urls = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(300)]
    ring = Ring(()).changed(urls)
    steps = [urls[1:], [*urls[1:], "http://new:1"], urls[:100], urls]
    for now in steps:
        ring = ring.changed(now)
        fresh = Ring(now)
        assert ring.distinct == fresh.distinct == len(set(now))
        assert all(ring.preferred(str(k), 4) == fresh.preferred(str(k), 4) for k in range(500))
    assert ring.changed(list(reversed(urls))) is ring  # the same set: nothing to do
