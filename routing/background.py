"""Background rounds that never stop for good (docs/architecture.md).

Every periodic task of a replica (sweep, spool flush, health probes, config reload, the
wake-up subscription) runs its rounds through `every`: an error in one round, whatever its
type, is counted per task, logged once per kind until the task recovers, and the next
round runs. Store errors of the store's tasks are logged by cause instead, once a minute
(routing/store/causes.py). Only cancellation stops a loop; a loop may back off while its
rounds fail. The counts are the metric `gateway_background_errors_total{task}`; task names
are fixed strings, never request text.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from routing.store.causes import StoreErrors

log = logging.getLogger("gateway.background")

# The background tasks of a replica: the label values of gateway_background_errors_total.
TASKS = ("sweep", "spool", "subscription", "health", "reload")
# Those whose rounds are store calls.
STORE_TASKS = frozenset({"sweep", "spool", "subscription"})


class BackgroundErrors:
    """Errors of background rounds: counted per task, each kind logged once per spell (store
    errors of the store's tasks by `store`, per cause, once a minute)."""

    def __init__(self, store: StoreErrors | None = None) -> None:
        self.counts: Counter[str] = Counter()
        self.store = store if store is not None else StoreErrors()
        self._failing: dict[str, set[str]] = {}

    def failed(self, task: str, exc: BaseException) -> None:
        self.counts[task] += 1
        kind = type(exc).__name__
        kinds = self._failing.setdefault(task, set())
        if task in STORE_TASKS and isinstance(exc, (RedisError, OSError)):  # TimeoutError too
            kinds.add(kind)
            self.store.report(exc, task)
        elif kind not in kinds:
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
    max_backoff_s: float | None = None,
) -> None:
    """Run `work` now and then every `interval_s` after each round ends, until cancelled.
    A round longer than `timeout_s` is cut and counts as an error. With `max_backoff_s`,
    failing rounds in a row wait longer and longer (`backoff`)."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    failures = 0
    while True:
        started = loop.time()
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
            # A round that ran for long (a subscription that listened, then broke) was no
            # spin: only quick failures in a row back off further.
            quick = max_backoff_s is not None and loop.time() - started < max_backoff_s
            failures = failures + 1 if quick else 1
        else:
            errors.succeeded(task_name)
            failures = 0
        if task is not None and task.cancelling():
            # Cancelled, but the round swallowed it (redis-py may, inside a pipeline).
            raise asyncio.CancelledError
        await asyncio.sleep(backoff(interval_s, failures, max_backoff_s))


def backoff(interval_s: float, failures: int, max_backoff_s: float | None) -> float:
    """The pause after a round: `interval_s`, doubled for each failed round in a row up to
    `max_backoff_s` (None: no backoff)."""
    if not failures or max_backoff_s is None:
        return interval_s
    return max(interval_s, min(max_backoff_s, max(interval_s, 0.1) * 2.0 ** min(failures, 20)))
