"""How long processes were kept off the CPU while they could run, over a test's run.

Linux counts it per process: the second field of /proc/<pid>/schedstat is the time spent
runnable on a run queue, waiting for a CPU. A timing check of the gateway's own logic
(e.g. "answered within the queue timeout plus a Redis deadline") allows that much more
for the processes on the request's path: on a machine busy with other work the gateway
was not late, it was not running. On a quiet machine the relief is near zero and the
check as strict as written. Where schedstat is missing the relief is 0.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


def run_queue_wait_s(pid: int) -> float | None:
    """The time `pid` has waited runnable for a CPU so far, or None if unknown."""
    try:
        with open(f"/proc/{pid}/schedstat", encoding="ascii") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class Starvation:
    """Samples of every watched process's run-queue wait, on the monotonic clock."""

    times: list[float] = field(default_factory=list)
    waits: list[dict[int, float]] = field(default_factory=list)

    def sample(self, pids: Iterable[int]) -> None:
        found = {pid: w for pid in pids if (w := run_queue_wait_s(pid)) is not None}
        self.times.append(time.monotonic())
        self.waits.append(found)

    def during(self, start: float, end: float) -> float:
        """The most any one watched process waited for a CPU between `start` and `end`
        (from the last sample before `start` to the first after `end`: never less)."""
        if not self.times:
            return 0.0
        first = max(0, bisect.bisect_right(self.times, start) - 1)
        last = min(len(self.times) - 1, bisect.bisect_left(self.times, end))
        before, after = self.waits[first], self.waits[last]
        return max((after[p] - before.get(p, 0.0) for p in after), default=0.0)


async def sample_until(
    pids: Callable[[], Iterable[int]], stop: asyncio.Event, every_s: float
) -> Starvation:
    """Sample `pids()` (asked anew each time: processes come and go) every `every_s`
    until `stop` is set, then once more."""
    seen = Starvation()
    while True:
        last = stop.is_set()
        seen.sample(pids())
        if last:
            return seen
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
