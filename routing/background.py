"""Background rounds that never stop for good (docs/architecture.md).

Every periodic task of a replica (sweep, spool flush, health probes, config reload, the
wake-up subscription) runs its rounds through `every`: an error in one round, whatever its
type, is counted per task, logged once per kind until the task recovers, and the next
round runs. Only cancellation stops a loop. The counts are the metric
`gateway_background_errors_total{task}`; task names are fixed strings, never request text.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

log = logging.getLogger("gateway.background")

# The background tasks of a replica: the label values of gateway_background_errors_total.
TASKS = ("sweep", "spool", "subscription", "health", "reload")


class BackgroundErrors:
    """Errors of background rounds: counted per task, each kind logged once per spell."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._failing: dict[str, set[str]] = {}

    def failed(self, task: str, exc: BaseException) -> None:
        self.counts[task] += 1
        kind = type(exc).__name__
        kinds = self._failing.setdefault(task, set())
        if kind not in kinds:
            kinds.add(kind)
            # The type and message only: messages of our own errors never hold request text.
            log.error("background task %s failed (%s: %s); it goes on", task, kind, exc)

    def succeeded(self, task: str) -> None:
        if self._failing.pop(task, None):
            log.info("background task %s recovered", task)


async def every(
    task_name: str,
    interval_s: float,
    work: Callable[[], Awaitable[object]],
    errors: BackgroundErrors,
    *,
    timeout_s: float | None = None,
) -> None:
    """Run `work` now and then every `interval_s` after each round ends, until cancelled.
    A round longer than `timeout_s` is cut and counts as an error."""
    task = asyncio.current_task()
    while True:
        try:
            if timeout_s is None:
                await work()
            else:
                async with asyncio.timeout(timeout_s):
                    await work()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a background loop must survive whatever one round raises
            errors.failed(task_name, exc)
        else:
            errors.succeeded(task_name)
        if task is not None and task.cancelling():
            # Cancelled, but the round swallowed it (redis-py may, inside a pipeline).
            raise asyncio.CancelledError
        await asyncio.sleep(interval_s)
