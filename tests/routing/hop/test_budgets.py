"""Token budgets: the AIMD step, `auto` read from the worker, per (model, endpoint), on a
fake clock; and their changes told through Health's `on_change`, once per probe round."""

from __future__ import annotations

import logging

import pytest

from gateway.runtime.settings import parse_config
from routing.hop.budgets import (
    DECREASE,
    HOLD_S,
    INCREASE_PER_S,
    TokenBudgets,
    next_fraction,
    overloaded,
)
from routing.hop.health import EndpointHealth, Health, HealthSettings
from routing.hop.scrape import Reading
from routing.registry import AdaptiveConfig, Registry

W1, W2 = "http://w1:8000", "http://w2:8000"
# a adapts on both its workers; b shares w2 with its own budget, fixed; c reads w1's size.
CONFIG = f"""
models:
  a:
    adaptive: {{enabled: true, min_fraction: 0.5, waiting_threshold: 2, kv_threshold: 0.9}}
    endpoints:
      - {{url: "{W1}", max_concurrency: 4, max_tokens_in_flight: 1000}}
      - {{url: "{W2}", max_concurrency: 4, max_tokens_in_flight: auto}}
  b: {{endpoints: [{{url: "{W2}", max_concurrency: 8, max_tokens_in_flight: 300}}]}}
  c: {{endpoints: [{{url: "{W1}", max_concurrency: 2, max_tokens_in_flight: auto}}]}}
  d: {{endpoints: [{{url: "http://w3:8000", max_concurrency: 2}}]}}
"""
IDLE = Reading(waiting=0.0, kv_usage=0.1)
BUSY = Reading(waiting=5.0, kv_usage=0.5)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def budgets(config: str = CONFIG) -> tuple[TokenBudgets, Clock]:
    clock = Clock()
    return TokenBudgets(Registry(parse_config(config, "t.yaml").models), clock), clock


# --- the AIMD step --------------------------------------------------------------------------


def step(fraction: float, over: bool, elapsed_s: float = 5.0, since: float = 100.0) -> float:
    return next_fraction(
        fraction, over, min_fraction=0.5, elapsed_s=elapsed_s, since_decrease_s=since
    )


def test_an_overloaded_reading_decreases_by_a_factor_down_to_the_floor() -> None:
    assert step(1.0, True) == DECREASE == 0.75
    assert step(0.75, True) == pytest.approx(0.5625)
    assert step(0.5625, True) == 0.5  # 0.42 is below min_fraction
    assert step(0.5, True) == 0.5


def test_a_decrease_holds_off_the_next_one() -> None:
    assert step(0.75, True, since=HOLD_S - 0.1) == 0.75
    assert step(0.75, True, since=HOLD_S) == pytest.approx(0.5625)


def test_a_quiet_reading_adds_back_in_proportion_to_the_time_since_the_last() -> None:
    assert INCREASE_PER_S == 0.01
    assert step(0.5, False, elapsed_s=5.0) == pytest.approx(0.55)
    assert step(0.5, False, elapsed_s=1.0) == pytest.approx(0.51)
    assert step(0.5, False, elapsed_s=3600.0) == pytest.approx(0.6)  # a gap counts as HOLD_S
    assert step(0.5, False, elapsed_s=-5.0) == 0.5  # a clock that went back adds nothing
    assert step(0.98, False) == 1.0


def test_a_fraction_below_a_new_floor_rises_to_it() -> None:
    assert step(0.3, True) == 0.5
    assert step(0.3, False, elapsed_s=0.0) == 0.5


@pytest.mark.parametrize(
    ("reading", "expected"),
    [
        (Reading(waiting=1.0, kv_usage=0.89), False),
        (Reading(waiting=2.0, kv_usage=0.0), True),  # waiting_threshold
        (Reading(waiting=0.0, kv_usage=0.9), True),  # kv_threshold
        (Reading(kv_usage=0.95), True),
        (Reading(waiting=0.0), False),
        (Reading(), None),  # the worker does not say
        (Reading(kv_tokens=100), None),
    ],
)
def test_what_is_overloaded(reading: Reading, expected: bool | None) -> None:
    adaptive = AdaptiveConfig(enabled=True, waiting_threshold=2, kv_threshold=0.9)
    assert overloaded(reading, adaptive) is expected


# --- budgets per (model, endpoint) ----------------------------------------------------------


def test_configured_budgets_and_what_each_endpoint_needs_read() -> None:
    b, _ = budgets()
    assert b.budget("a", W1) == 1000 and b.budget("b", W2) == 300
    assert b.budget("a", W2) is None and b.budget("c", W1) is None  # auto: not read yet
    assert b.budget("d", "http://w3:8000") is None and b.budget("a", "http://gone") is None
    assert b.needs(W1) == (True, True)  # a adapts on it, c reads its size
    assert b.needs(W2) == (True, True)
    assert b.needs("http://w3:8000") == (False, False)


def test_auto_is_read_said_once_until_then_and_follows_a_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    b, _ = budgets()
    with caplog.at_level(logging.INFO, logger="gateway.health"):
        assert b.observe(W1, None) is False
        assert b.observe(W1, Reading()) is False
        unknown = [r for r in caplog.records if "not told" in r.getMessage()]
        assert len(unknown) == 1 and W1 in unknown[0].getMessage()
        assert b.observe(W1, Reading(kv_tokens=4096)) is True
        assert b.budget("c", W1) == 4096 and b.budget("a", W1) == 1000  # a's is a number
        assert b.observe(W1, Reading(kv_tokens=4096)) is False
        assert b.observe(W1, Reading()) is False  # no longer told: the last size stays
        assert b.budget("c", W1) == 4096
        assert b.observe(W1, Reading(kv_tokens=2048)) is True  # restarted smaller
    assert b.budget("c", W1) == b.whole("c", W1) == 2048  # no more, even alone
    assert b.whole("a", W1) == 1000 and b.whole("a", "http://gone") is None
    assert any("now 2048 tokens (was 4096)" in r.getMessage() for r in caplog.records)


def test_a_budget_adapts_per_model_on_a_shared_worker() -> None:
    b, clock = budgets()
    assert b.observe(W2, Reading(waiting=0.0, kv_usage=0.1, kv_tokens=2000)) is True
    assert (b.budget("a", W2), b.budget("b", W2)) == (2000, 300)
    seen = []
    for _ in range(4):  # overloaded: down by a quarter per hold, to min_fraction
        clock.now += HOLD_S
        changed = b.observe(W2, Reading(waiting=5.0, kv_usage=0.5, kv_tokens=2000))
        seen.append((changed, b.budget("a", W2)))
    assert seen == [(True, 1500), (True, 1125), (True, 1000), (False, 1000)]
    assert b.whole("a", W2) == 2000  # adapted, not restarted: a lone request may hold it
    assert b.budget("b", W2) == 300  # b does not adapt
    clock.now += 1.0
    assert b.observe(W2, BUSY) is False  # still overloaded, inside the hold: no change
    grown = []
    while b.budget("a", W2) != 2000:  # quiet: +1 % of 2000 a second, 5 s a probe
        clock.now += 5.0
        assert b.observe(W2, IDLE) is True
        grown.append(b.budget("a", W2))
    assert grown == [1100, 1200, 1300, 1400, 1500, 1600, 1700, 1800, 1900, 2000]
    clock.now += 5.0
    assert b.observe(W2, IDLE) is False  # whole: nothing to write


def test_a_reading_without_load_gauges_leaves_the_fraction_alone() -> None:
    b, clock = budgets()
    clock.now += HOLD_S
    b.observe(W1, BUSY)
    assert b.budget("a", W1) == 750
    clock.now += 60
    assert b.observe(W1, Reading(kv_tokens=10)) is True  # c's size changed, not a's
    assert b.budget("a", W1) == 750 and b.budget("c", W1) == 10


def test_a_reload_keeps_what_was_read_and_learnt() -> None:
    b, clock = budgets()
    b.observe(W2, Reading(waiting=9.0, kv_tokens=2000))
    assert b.budget("a", W2) == 1500
    again = TokenBudgets(Registry(parse_config(CONFIG, "t.yaml").models), clock)
    again.adopt(b)
    assert again.budget("a", W2) == 1500 and again.budget("b", W2) == 300
    off = CONFIG.replace("enabled: true", "enabled: false")
    plain = TokenBudgets(Registry(parse_config(off, "t.yaml").models), clock)
    plain.adopt(again)
    assert plain.budget("a", W2) == 2000  # no longer adaptive: the whole budget


# --- through Health: changes told once a round ----------------------------------------------


def test_health_tells_a_budget_change_of_an_endpoint() -> None:
    changes: list[set[str]] = []
    clock = Clock()
    registry = Registry(parse_config(CONFIG, "t.yaml").models)
    health = Health(registry, HealthSettings(), changes.append, clock=clock)
    health.probed(W2, ok=True, reading=Reading(waiting=0.0, kv_tokens=640))
    assert changes == [{W2}] and health.budget("a", W2) == 640
    health.probed(W2, ok=True, reading=Reading(waiting=0.0, kv_tokens=640))
    assert changes == [{W2}]  # nothing changed: nothing told
    assert health.penalty(W2) == 0.0  # read for its budget, not for a penalty


async def test_a_rounds_changes_are_told_in_one_call() -> None:
    changes: list[set[str]] = []
    registry = Registry(parse_config(CONFIG, "t.yaml").models)
    health = Health(registry, HealthSettings(unhealthy_after=1), changes.append, clock=Clock())
    readings = {W1: Reading(kv_tokens=64), W2: Reading(kv_tokens=32)}

    async def probe(h: EndpointHealth) -> tuple[bool, Reading | None]:
        return h.url in readings, readings.get(h.url)

    health._probe = probe  # type: ignore[assignment, method-assign]
    await health.probe_all()
    # w1 and w2 learnt their sizes, w3 went out: one call.
    assert changes == [{W1, W2, "http://w3:8000"}]
