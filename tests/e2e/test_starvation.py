"""tests/e2e/starvation.py: the run-queue wait of a window, from samples around it."""

from __future__ import annotations

import os

from tests.e2e.starvation import Starvation, run_queue_wait_s


def test_a_window_gets_the_most_one_process_waited_from_the_samples_around_it() -> None:
    seen = Starvation(
        times=[0.0, 1.0, 2.0, 3.0],
        waits=[{1: 0.0, 2: 0.0}, {1: 0.1, 2: 0.5}, {1: 0.2, 2: 0.6, 3: 0.3}, {1: 0.9, 3: 0.4}],
    )
    # From the last sample at or before the start to the first at or after the end; a
    # process started inside the window counts from zero (process 3: 0.3).
    assert abs(seen.during(1.0, 2.0) - 0.3) < 1e-9
    assert abs(seen.during(0.5, 1.5) - 0.6) < 1e-9  # process 2: 0.6 - 0.0
    # One gone by the window's end is not counted (a killed replica answers nobody).
    assert abs(seen.during(1.5, 3.0) - 0.8) < 1e-9  # process 1: 0.9 - 0.1
    assert Starvation().during(0.0, 9.0) == 0.0


def test_this_process_has_a_run_queue_wait_on_linux() -> None:
    wait = run_queue_wait_s(os.getpid())
    assert wait is None or wait >= 0.0
    assert run_queue_wait_s(2**22 + 12345) is None  # no such process
