"""Endpoint choice inside a model: fewest in flight, ties rotate."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from routing.endpoints import Pool, Pools
from routing.registry import ModelConfig, Registry


def pool(count: int, name: str = "m") -> Pool:
    endpoints = [{"url": f"http://10.0.0.{i + 1}:8000", "max_concurrency": 8} for i in range(count)]
    registry = Registry({name: ModelConfig.model_validate({"endpoints": endpoints})})
    model = registry.get(name)
    assert model is not None
    return Pool(model)


def test_single_endpoint_always_picked() -> None:
    p = pool(1)
    assert {id(p.pick()) for _ in range(5)} == {id(p.endpoints[0])}


def test_fewest_in_flight_wins() -> None:
    p = pool(3)
    p.endpoints[0].inflight = 5
    p.endpoints[1].inflight = 1
    p.endpoints[2].inflight = 3
    for _ in range(6):
        assert p.pick() is p.endpoints[1]


def test_fewest_in_flight_wins_wherever_it_sits() -> None:
    for idle in range(4):
        p = pool(4)
        for i, endpoint in enumerate(p.endpoints):
            endpoint.inflight = 0 if i == idle else 2
        assert all(p.pick() is p.endpoints[idle] for _ in range(8))


def test_equal_loads_alternate() -> None:
    p = pool(2)
    picks = [p.pick() for _ in range(6)]
    assert all(a is not b for a, b in pairwise(picks))


def test_equal_loads_spread_evenly() -> None:
    p = pool(3)
    counts = Counter(p.pick().url for _ in range(30))
    assert counts == {e.url: 10 for e in p.endpoints}


def test_picks_follow_in_flight_counts() -> None:
    p = pool(2)
    for _ in range(10):
        p.pick().inflight += 1
    assert [e.inflight for e in p.endpoints] == [5, 5]


def test_busy_endpoint_skipped() -> None:
    p = pool(3)
    p.endpoints[0].inflight = 4
    assert p.endpoints[0] not in [p.pick() for _ in range(6)]


def test_ties_among_least_loaded_share_evenly_beside_a_busy_endpoint() -> None:
    p = pool(3)
    p.endpoints[0].inflight = 4
    counts = Counter(p.pick().url for _ in range(30))
    assert counts == {p.endpoints[1].url: 15, p.endpoints[2].url: 15}


def test_pools_by_model_name() -> None:
    endpoints = [{"url": "http://w:1", "max_concurrency": 1}]
    registry = Registry(
        {
            "a": ModelConfig.model_validate({"endpoints": endpoints}),
            "b": ModelConfig.model_validate({"endpoints": endpoints, "tiers": ["flex"]}),
        }
    )
    pools = Pools(registry)
    assert pools.for_model("a") is not pools.for_model("b")
    assert pools.for_model("b").endpoints[0].model_name == "b"
