"""Passing one future's outcome to another, for the callbacks of the store's hot path (no
task per call): a batch's replies, or its failure, reach whoever awaits the outer future."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any


def chain(target: asyncio.Future[list[Any]], source: asyncio.Future[list[Any]]) -> None:
    """Settle `target` as `source` settled (a done callback of `source`, bound with partial);
    a `target` already settled (its caller gave up) is left alone."""
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif (exc := source.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


def shielded(work: asyncio.Future[list[Any]]) -> asyncio.Future[list[Any]]:
    """A future to await for `work`'s outcome that a cancel of its waiter leaves `work`
    alone: `asyncio.shield` for a future, without its two closures and its checks (the
    store's hot path awaits one per acquire)."""
    if work.done():
        return work
    outer: asyncio.Future[list[Any]] = work.get_loop().create_future()
    work.add_done_callback(partial(chain, outer))
    return outer
