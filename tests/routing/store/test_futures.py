"""Passing futures' outcomes on (routing/store/futures.py): `shielded`, the hot path's
`asyncio.shield` for a future, keeps its promise: a cancelled waiter leaves the work alone."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from routing.store.futures import shielded


async def test_the_outcome_reaches_the_waiter() -> None:
    work: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(shielded(work))
    work.set_result([1, 2])
    assert await waiter == [1, 2]


async def test_an_error_reaches_the_waiter() -> None:
    work: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(shielded(work))
    work.set_exception(ConnectionError("gone"))
    with pytest.raises(ConnectionError, match="gone"):
        await waiter


async def test_a_cancelled_waiter_leaves_the_work_running() -> None:
    work: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
    started = asyncio.Event()

    async def wait() -> list[Any]:
        started.set()
        return await shielded(work)

    task = asyncio.create_task(wait())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not work.cancelled() and not work.done()
    work.set_result([3])  # settling it later is harmless: the outer one is left alone
    await asyncio.sleep(0)
    assert work.result() == [3]


async def test_done_work_is_its_own_answer() -> None:
    work: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
    work.set_result([])
    assert shielded(work) is work
