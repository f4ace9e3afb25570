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
    """FIFO admission to `size` generation slots and, with `budget`, a KV cache of that many
    tokens (asyncio.Semaphore promises no order). A request runs while both have room for it
    (its prompt and its answer: what vLLM's cache must hold for it by its end); else it
    waits, first come first served, as vLLM's scheduler queues (`num_requests_waiting`)."""

    def __init__(self, size: int, budget: int | None = None) -> None:
        self.size = size
        self.budget = budget
        self.running = 0
        self.tokens = 0  # of the requests running
        # High-water marks, so tests can prove the gateway never overloaded this worker:
        # since start, and since the last `take_window` (running, waiting, both together,
        # tokens of the running).
        self.peak_running = 0
        self.peak_waiting = 0
        self.peak_tokens = 0
        self.window = (0, 0, 0, 0)
        self._waiters: deque[tuple[asyncio.Future[None], int]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def fits_ever(self, tokens: int) -> bool:
        """Whether a request of `tokens` could run at all (alone in an empty cache)."""
        return self.budget is None or tokens <= self.budget

    def _note(self) -> None:
        running, waiting, tokens = self.running, len(self._waiters), self.tokens
        self.peak_running = max(self.peak_running, running)
        self.peak_waiting = max(self.peak_waiting, waiting)
        self.peak_tokens = max(self.peak_tokens, tokens)
        peaks = self.window
        self.window = (
            max(peaks[0], running),
            max(peaks[1], waiting),
            max(peaks[2], running + waiting),
            max(peaks[3], tokens),
        )

    def take_window(self) -> tuple[int, int, int, int]:
        """The peaks (running, waiting, in flight, tokens) since the last call; a new window
        starts at the load of now."""
        peaks = self.window
        self.window = (self.running, self.waiting, self.running + self.waiting, self.tokens)
        return peaks

    def _room(self, tokens: int) -> bool:
        return self.running < self.size and (
            self.budget is None or self.tokens + tokens <= self.budget
        )

    def _take(self, tokens: int) -> None:
        self.running += 1
        self.tokens += tokens

    def try_acquire(self, tokens: int = 0) -> bool:
        if not self._waiters and self._room(tokens):
            self._take(tokens)
            self._note()
            return True
        return False

    async def acquire(self, tokens: int = 0) -> None:
        if self.try_acquire(tokens):
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((waiter, tokens))
        self._note()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(tokens)  # the slot was handed over just before the cancel
            else:
                with suppress(ValueError):
                    self._waiters.remove((waiter, tokens))
                self._wake()  # the head may have been what held the others back
            raise

    def release(self, tokens: int = 0) -> None:
        self.running -= 1
        self.tokens -= tokens
        self._wake()

    def _wake(self) -> None:
        """Hand slots to the waiters at the head while they fit (first come, first served:
        one that does not fit holds back those behind it, as vLLM's FCFS scheduler does)."""
        while self._waiters:
            waiter, tokens = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            if not self._room(tokens):
                break
            self._waiters.popleft()
            self._take(tokens)
            waiter.set_result(None)
        self._note()


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
