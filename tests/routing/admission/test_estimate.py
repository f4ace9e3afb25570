"""Retry-After (docs/api.md): an estimate from the queue ahead and the rate slots free."""

from __future__ import annotations

from routing.admission.estimate import MAX_RETRY_AFTER_S, RetryAfter, retry_after_s


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


# --- the estimate itself: a pure function of the measures --------------------------------


def test_unmeasured_it_counts_the_queue_ahead_up_to_the_cap() -> None:
    assert [retry_after_s(ahead, 8, 0.0, None) for ahead in (0, 5, 500)] == [
        1,
        6,
        MAX_RETRY_AFTER_S,
    ]


def test_the_freed_rate_alone() -> None:
    assert retry_after_s(0, 8, 2.0, None) == 1
    assert retry_after_s(9, 8, 2.0, None) == 5  # 10 slots to free at 2 a second
    assert retry_after_s(1000, 8, 2.0, None) == MAX_RETRY_AFTER_S


def test_the_hold_time_floor_wins_over_a_slower_measured_rate() -> None:
    # 8 slots held 0.5 s each free 16 a second, whatever the measured rate says.
    assert retry_after_s(40, 8, 0.001, 0.5) == 3
    assert retry_after_s(40, 8, 0.0, 0.5) == 3
    # A faster measured rate wins over the floor.
    assert retry_after_s(40, 8, 41.0, 0.5) == 1


def test_the_hold_time_says_nothing_without_capacity() -> None:
    assert retry_after_s(5, 0, 0.0, 0.5) == 6
    assert retry_after_s(5, 0, 2.0, 0.5) == 3


def test_never_below_one_second_even_for_instant_holds() -> None:
    assert retry_after_s(0, 8, 0.0, 0.0) == 1
    assert retry_after_s(0, 1000, 1e9, 1e-9) == 1


def test_the_same_inputs_give_the_same_answer() -> None:
    """Pure: the per-model measures live in `RetryAfter`, the estimate reads only its
    arguments."""
    estimate = RetryAfter()
    estimate.freed("m", 0.0, 0)
    estimate.freed("m", 1.0, 3)
    estimate.held("m", 2.0)
    expected = retry_after_s(7, 4, estimate.freed_rate["m"], estimate.hold_s["m"])
    assert estimate.seconds("m", 7, 4) == expected == retry_after_s(7, 4, 3.0, 2.0) == 3
