"""The scorers in Python are the rules the acquire script follows (prelude_seats.lua):
`score` is what `rescore` writes into `free` (less the tie-break, below 1e-6), checked
against the Lua itself through the harness."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from routing.choice.load import score
from routing.choice.penalty import penalty
from routing.choice.pick import least_loaded
from tests.routing.store.test_lua_functions import call


@pytest.mark.parametrize(
    ("load", "size", "extra", "reserved", "budget"),
    [(0, 4, 0.0, 0, None), (3, 8, 0.5, 0, None), (1, 2, 0.0, 900, 1000), (2, 4, 1.25, 100, 1000)],
)
async def test_the_score_is_the_one_free_ranks_by(
    real_redis: aioredis.Redis, load: int, size: int, extra: float, reserved: int,
    budget: int | None,
) -> None:  # fmt: skip
    """`rescore` puts an endpoint with room into `free` at its score (plus a tie-break
    below 1e-6)."""
    spec = f"{size} {extra}" + ("" if budget is None else f" {budget} {budget}")
    body = (
        f"redis.call('HSET', EPS, 'http://a', '{spec}')\n"
        f"rescore('http://a', {load}, nil, {reserved})\n"
        "redis.call('DEL', EPS)\n"
        "local s = redis.call('ZSCORE', FREE, 'http://a')\n"
        "redis.call('DEL', FREE)\n"
        "return s"
    )
    (found,) = await call(real_redis, f"(function() {body} end)()")
    expected = score(load, size, extra, reserved, budget)
    assert expected is not None and 0 <= float(found) - expected < 1e-6


def test_a_full_endpoint_has_no_score() -> None:
    assert score(4, 4) is None and score(1, 4, reserved=1000, budget=1000) is None


def test_the_penalty_weighs_the_queue_by_size_and_the_kv_cache() -> None:
    assert penalty(None, None, 8) == 0.0
    assert penalty(4, 0.5, 8) == 1.0  # half a size queued, half the cache used
    assert penalty(100, 3.0, 8) == 3.0  # each capped: 2 for the queue, 1 for the cache


def test_the_outage_picker_takes_the_lowest_score_in_turn() -> None:
    loads = [(3, 8, 0.0), (1, 2, 0.0), (3, 8, 0.0)]  # 0.375, 0.5, 0.375
    assert [least_loaded(loads, turn) for turn in range(4)] == [0, 2, 0, 2]
    assert least_loaded([(2, 2, 0.0), (3, 2, 0.0)], 0) == 0  # none with room: least over
    assert least_loaded([], 0) is None
