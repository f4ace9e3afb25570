"""Background rounds never stop for good: any error is counted, logged once, and
the next round runs."""

from __future__ import annotations

import asyncio
import logging

import pytest

from routing.background import BackgroundErrors, every


async def test_a_round_that_raises_anything_is_counted_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    errors = BackgroundErrors()
    rounds: list[int] = []
    done = asyncio.Event()

    async def work() -> None:
        rounds.append(len(rounds))
        if len(rounds) <= 3:
            raise ValueError("a torn line, say")
        if len(rounds) == 5:
            done.set()

    with caplog.at_level(logging.INFO, logger="gateway.background"):
        task = asyncio.create_task(every("spool", 0.0, work, errors))
        await asyncio.wait_for(done.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert errors.counts["spool"] == 3
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1  # once per kind, not once per round
    assert any("recovered" in r.getMessage() for r in caplog.records)


async def test_a_round_past_its_timeout_is_cut_and_counted() -> None:
    errors = BackgroundErrors()
    calls = 0
    done = asyncio.Event()

    async def work() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.Event().wait()  # a stall: never returns by itself
        done.set()

    task = asyncio.create_task(every("sweep", 0.0, work, errors, timeout_s=0.05))
    await asyncio.wait_for(done.wait(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert errors.counts["sweep"] == 1


async def test_a_cancel_the_round_swallowed_still_stops_the_loop() -> None:
    """redis-py may swallow a cancellation inside a pipeline: the loop stops all the same
    (else shutting the keeper down would hang)."""
    errors = BackgroundErrors()
    inside = asyncio.Event()

    async def swallowing() -> None:
        inside.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return  # what a library should not do, but does

    task = asyncio.create_task(every("sweep", 0.0, swallowing, errors))
    await asyncio.wait_for(inside.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
