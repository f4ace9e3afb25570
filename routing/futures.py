"""Passing one future's outcome to another, for the callbacks of the store's hot path (no
task per call): a batch's replies, or its failure, reach whoever awaits the outer future."""

from __future__ import annotations

import asyncio
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
