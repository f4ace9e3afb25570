"""Endpoint choice inside a model while Redis is away (routing/choice/pick.py): the lowest
load relative to its size plus its worker's penalty, of the endpoints up; ties rotate."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from typing import Any

from routing.hop.endpoints import Endpoint, Pool, Pools
from routing.registry import ModelConfig, Registry


def pool(count: int, name: str = "m") -> Pool:
    endpoints = [{"url": f"http://10.0.0.{i + 1}:8000", "max_concurrency": 8} for i in range(count)]
    registry = Registry({name: ModelConfig.model_validate({"endpoints": endpoints})})
    model = registry.get(name)
    assert model is not None
    return Pool(model)


def pick(p: Pool, *steer: Any) -> Endpoint:
    """The pool's pick (`steer`: its penalty and up): there is one (None is for a model
    with no endpoint left)."""
    endpoint = p.pick(*steer)
    assert endpoint is not None
    return endpoint


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
    counts = Counter(pick(p).url for _ in range(30))
    assert counts == {e.url: 10 for e in p.endpoints}


def test_picks_follow_in_flight_counts() -> None:
    p = pool(2)
    for _ in range(10):
        pick(p).inflight += 1
    assert [e.inflight for e in p.endpoints] == [5, 5]


def test_busy_endpoint_skipped() -> None:
    p = pool(3)
    p.endpoints[0].inflight = 4
    assert p.endpoints[0] not in [p.pick() for _ in range(6)]


def test_ties_among_least_loaded_share_evenly_beside_a_busy_endpoint() -> None:
    p = pool(3)
    p.endpoints[0].inflight = 4
    counts = Counter(pick(p).url for _ in range(30))
    assert counts == {p.endpoints[1].url: 15, p.endpoints[2].url: 15}


def test_the_load_counts_relative_to_each_endpoints_size() -> None:
    """As the acquire script's `free`: 3 of 8 is less loaded than 1 of 2."""
    endpoints = [
        {"url": "http://big:8000", "max_concurrency": 8},
        {"url": "http://small:8000", "max_concurrency": 2},
    ]
    model = Registry({"m": ModelConfig.model_validate({"endpoints": endpoints})}).get("m")
    assert model is not None
    p = Pool(model)
    p.endpoints[0].inflight, p.endpoints[1].inflight = 3, 1
    assert all(pick(p).url == "http://big:8000" for _ in range(4))


def test_a_workers_penalty_and_health_steer_the_choice() -> None:
    p = pool(3)
    penalties = {p.endpoints[0].url: 0.5, p.endpoints[1].url: 0.0, p.endpoints[2].url: 0.0}
    down = {p.endpoints[2].url}
    picks = {pick(p, penalties.__getitem__, lambda url: url not in down).url for _ in range(6)}
    assert picks == {p.endpoints[1].url}
    # None up (this replica's health may lag): any of them, by load.
    assert p.pick(up=lambda url: False) is not None


def test_pools_by_model_name() -> None:
    endpoints = [{"url": "http://w:1", "max_concurrency": 1}]
    registry = Registry(
        {
            "a": ModelConfig.model_validate({"endpoints": endpoints}),
            "b": ModelConfig.model_validate({"endpoints": endpoints, "tiers": ["flex"]}),
        }
    )
    pools = Pools(registry)
    a, b = pools.for_model("a"), pools.for_model("b")
    assert a is not None and b is not None and a is not b
    assert b.endpoints[0].model_name == "b"


# --- config reloads: endpoints that stay, change, leave or come back -------------------------

A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


def registry(**models: list[dict[str, object]]) -> Registry:
    return Registry({n: ModelConfig.model_validate({"endpoints": e}) for n, e in models.items()})


def endpoint(url: str, size: int = 8, **extra: object) -> dict[str, object]:
    return {"url": url, "max_concurrency": size, **extra}


def test_an_endpoint_that_stays_keeps_its_object_and_count_with_the_new_settings() -> None:
    pools = Pools(registry(m=[endpoint(A), endpoint(B)]))
    before = pools.find("m", A)
    assert before is not None
    before.inflight = 3
    pools.apply(registry(m=[endpoint(A, 2, model="served-now")]))
    assert pools.find("m", A) is before
    assert before.inflight == 3
    assert (before.config.max_concurrency, before.upstream_model) == (2, "served-now")


def test_an_endpoint_that_leaves_stays_findable_while_a_lease_holds_it() -> None:
    pools = Pools(registry(m=[endpoint(A), endpoint(B)]))
    leaving = pools.find("m", A)
    pools.apply(registry(m=[endpoint(B)]), in_use=[("m", A)])
    assert pools.find("m", A) is leaving  # a request admitted onto it still finds it
    pool = pools.for_model("m")
    assert pool is not None
    assert [pool.pick() for _ in range(4)] == [pool.by_url[B]] * 4  # but it takes no new work
    pools.apply(registry(m=[endpoint(B)]), in_use=[("m", B)])
    assert pools.find("m", A) is None  # pruned once no lease holds it


def test_a_retired_endpoint_that_comes_back_is_the_same_object() -> None:
    pools = Pools(registry(m=[endpoint(A), endpoint(B)]))
    leaving = pools.find("m", A)
    assert leaving is not None
    leaving.inflight = 1
    pools.apply(registry(m=[endpoint(B)]), in_use=[("m", A)])
    pools.apply(registry(m=[endpoint(A), endpoint(B)]), in_use=[("m", A)])
    assert pools.find("m", A) is leaving and leaving.inflight == 1


def test_a_model_that_leaves_keeps_its_pool_only_while_held() -> None:
    pools = Pools(registry(m=[endpoint(A)], other=[endpoint(B)]))
    held = pools.find("m", A)
    pools.apply(registry(other=[endpoint(B)]), in_use=[("m", A)])
    assert pools.find("m", A) is held
    assert pools.pick("m") is None  # nothing new goes to a model that left
    pools.apply(registry(other=[endpoint(B)]))
    assert pools.for_model("m") is None and pools.find("m", A) is None


def test_unknown_models_and_urls_are_none() -> None:
    pools = Pools(registry(m=[endpoint(A)]))
    assert pools.find("m", B) is None
    assert pools.find("nope", A) is None
    assert pools.pick("nope") is None
