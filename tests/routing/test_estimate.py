"""Retry-After (docs/api.md): an estimate from the queue ahead and the rate slots free."""

from __future__ import annotations

from routing.estimate import MAX_RETRY_AFTER_S, RetryAfter


def test_without_any_measure_it_is_the_queue_ahead() -> None:
    estimate = RetryAfter()
    assert estimate.seconds("m", 0, 8) == 1
    assert estimate.seconds("m", 5, 8) == 6
    assert estimate.seconds("m", 500, 8) == MAX_RETRY_AFTER_S


def test_the_fleets_rate_of_freed_slots() -> None:
    estimate = RetryAfter()
    estimate.freed("m", 0.0, 100)
    estimate.freed("m", 1.0, 102)  # 2 slots a second
    assert estimate.seconds("m", 0, 8) == 1
    assert estimate.seconds("m", 9, 8) == 5


def test_an_idle_spell_does_not_drive_it_to_the_cap() -> None:
    """Item 13: slots freed every second before, then nothing for 20 s (nobody asked): the
    measured rate decays towards zero, but requests still hold a slot ~0.5 s, so a burst
    gets a short estimate, not 60 s."""
    estimate = RetryAfter()
    for second in range(10):
        estimate.freed("m", float(second), second * 8)
        estimate.held("m", 0.5)
    for second in range(10, 30):
        estimate.freed("m", float(second), 72)  # idle
    assert estimate.freed_rate["m"] < 0.01
    assert estimate.seconds("m", 0, 8) == 1  # 8 slots / 0.5 s = 16 a second
    assert estimate.seconds("m", 40, 8) == 3


def test_a_counter_that_restarted_with_redis_is_not_a_negative_rate() -> None:
    estimate = RetryAfter()
    estimate.freed("m", 0.0, 500)
    estimate.freed("m", 1.0, 3)  # Redis restarted empty
    assert "m" not in estimate.freed_rate
    estimate.freed("m", 2.0, 7)
    assert estimate.freed_rate["m"] == 4.0
