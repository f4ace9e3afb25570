"""A simulated worker's load (gateway/sim/worker.py): its FIFO generation slots, their peaks, and
the span each request spent at the worker."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from typing import Any


class Slots:
    """FIFO admission to `size` generation slots (asyncio.Semaphore promises no order)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.running = 0
        # High-water marks, so tests can prove the gateway never overloaded this worker:
        # since start, and since the last `take_window` (running, waiting, both together).
        self.peak_running = 0
        self.peak_waiting = 0
        self.window = (0, 0, 0)
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _note(self) -> None:
        running, waiting = self.running, len(self._waiters)
        self.peak_running = max(self.peak_running, running)
        self.peak_waiting = max(self.peak_waiting, waiting)
        peaks = self.window
        self.window = (
            max(peaks[0], running),
            max(peaks[1], waiting),
            max(peaks[2], running + waiting),
        )

    def take_window(self) -> tuple[int, int, int]:
        """The peaks (running, waiting, in flight) since the last call; a new window starts
        at the load of now."""
        peaks = self.window
        self.window = (self.running, self.waiting, self.running + self.waiting)
        return peaks

    def try_acquire(self) -> bool:
        if self.running < self.size and not self._waiters:
            self.running += 1
            self._note()
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._note()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over just before the cancel: pass it on
            else:
                with suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # hand the slot over; `running` stays the same
                return
        self.running -= 1


class Span:
    """One request's time at this worker, from asking for a slot until it gave the slot (or
    its place in line) up; handed to `done` as [id, start, end, aborted] when it ends.
    Times are time.monotonic(), which on one host all processes share."""

    def __init__(self, request_id: str, done: Callable[[list[Any]], None]) -> None:
        self._id = request_id
        self._done = done
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.monotonic()

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self._done([self._id, self._start, time.monotonic(), kind is not None])
