"""Retry-After: when a slot is likely free for a newcomer (an estimate, not a constant).

Two views of how fast a model frees slots, and the faster one wins:
- the fleet's measured rate: the `freed` counter in Redis, read by every sweep, smoothed;
- a floor from how long requests hold a slot here (smoothed hold times at release):
  a model whose `capacity` slots are busy frees about capacity / hold time per second.
The floor keeps the estimate honest after an idle spell, when the measured rate has decayed
towards zero although slots will free every second again as soon as traffic resumes.

`retry_after_s` is the estimate itself, a pure function of those measures; `RetryAfter`
keeps the measures per model.
"""

from __future__ import annotations

import math

# Past this, a computed Retry-After says more about noise than about the queue.
MAX_RETRY_AFTER_S = 60
# Weight of the newest sample in the smoothed values.
WEIGHT = 0.3


class RetryAfter:
    def __init__(self) -> None:
        self.freed_rate: dict[str, float] = {}
        self.hold_s: dict[str, float] = {}
        self._last_freed: dict[str, tuple[float, int]] = {}

    def freed(self, model: str, now: float, total: int) -> None:
        """The fleet's `freed` counter of `model`, read at `now` (seconds)."""
        previous = self._last_freed.get(model)
        self._last_freed[model] = (now, total)
        if previous is None or now <= previous[0] or total < previous[1]:
            return  # first reading, or the counter restarted with Redis
        sample = (total - previous[1]) / (now - previous[0])
        old = self.freed_rate.get(model)
        self.freed_rate[model] = sample if old is None else old + WEIGHT * (sample - old)

    def held(self, model: str, seconds: float) -> None:
        """A request of `model` held its slot this long."""
        old = self.hold_s.get(model)
        self.hold_s[model] = seconds if old is None else old + WEIGHT * (seconds - old)

    def seconds(self, model: str, ahead: int, capacity: int) -> int:
        """Whole seconds until a slot of `model` is likely free with `ahead` waiters in front."""
        rate, hold = self.freed_rate.get(model, 0.0), self.hold_s.get(model)
        return retry_after_s(ahead, capacity, rate, hold)

    def rate(self, model: str, capacity: int) -> float:
        """Slots of `model` likely freed per second (0: nothing measured yet)."""
        return service_rate(capacity, self.freed_rate.get(model, 0.0), self.hold_s.get(model))


def retry_after_s(ahead: int, capacity: int, freed_rate: float, hold_s: float | None) -> int:
    """Whole seconds until a slot is likely free with `ahead` waiters in front, for a model
    of `capacity` slots that the fleet frees at `freed_rate` a second and that requests hold
    `hold_s` seconds (None: not measured yet)."""
    rate = service_rate(capacity, freed_rate, hold_s)
    if rate <= 0.0:
        return 1 + min(ahead, MAX_RETRY_AFTER_S - 1)
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil((ahead + 1) / rate)))


def service_rate(capacity: int, freed_rate: float, hold_s: float | None) -> float:
    """Slots freed per second: the fleet's measured rate, or capacity / hold time if that is
    faster (0: neither measured yet)."""
    rate = freed_rate
    if hold_s is not None and capacity > 0:
        rate = max(rate, capacity / max(hold_s, 0.001))
    return rate


def max_turn(remaining_s: float, rate: float, parts: int) -> int | None:
    """The most grants a request may wait behind in one of `parts` partitions' queues and
    still be served within `remaining_s` at `rate` (slots a second, over the model): its own
    grant is the turn + 1-th (-1: not even first). None when the rate is not known."""
    if rate <= 0.0:
        return None
    return math.floor(max(0.0, remaining_s) * rate / max(1, parts)) - 1


def wait_s(turn: int, rate: float) -> float | None:
    """The wait of a request with `turn` grants ahead of it over the model (None: unknown)."""
    return (turn + 1) / rate if rate > 0.0 else None
