"""Failing background loops back off (routing/background.py `backoff`, `every`): the pause
doubles up to its cap, and a success resets it. (How their store errors are reported:
tests/routing/store/test_storeerrors.py.)"""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import AuthenticationError

from routing.background import BackgroundErrors, backoff, every


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff(0.5, n, 10.0) for n in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff(0.5, 5, None) == 0.5  # no backoff asked
    assert backoff(30.0, 3, 10.0) == 30.0  # never below the interval


async def test_a_failing_loop_backs_off_and_a_success_resets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses: list[float] = []
    done = asyncio.Event()
    sleep = asyncio.sleep

    async def recorded(delay: float) -> None:
        pauses.append(delay)
        if len(pauses) == 6:
            done.set()
        await sleep(0)

    outcomes = iter([False, False, False, False, True, False])

    async def work() -> None:
        if not next(outcomes, True):
            raise AuthenticationError("invalid username-password pair or user is disabled.")

    monkeypatch.setattr(asyncio, "sleep", recorded)  # the sleep of routing/background.py
    task = asyncio.create_task(
        every("subscription", 0.5, work, BackgroundErrors(), max_backoff_s=10.0)
    )
    await asyncio.wait_for(done.wait(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert pauses[:6] == [1.0, 2.0, 4.0, 8.0, 0.5, 1.0]
