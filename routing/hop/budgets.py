"""Each endpoint's token budget as admission should hold it: configured, read, adapted.

An endpoint's budget is per (model, endpoint): `max_tokens_in_flight` is set per model's
endpoint, and one worker serving several models may be given several. A number is the
budget; `auto` is the worker's KV cache in tokens, read from its /metrics on every probe
(vLLM's `vllm:cache_config_info`: num_gpu_blocks x block_size; a worker restarted with
another size is followed); until read, the endpoint has no budget (admission counts its
requests only). With the model's `adaptive.enabled`, a fraction of that budget, in
[min_fraction, 1], follows what the worker says of its load (`next_fraction`): AIMD, as
TCP's congestion window, because the signal (requests queued in the worker, its KV cache
nearly full) says only "too much", never how much room there is.

The probes feed it (routing/hop/health.py `Health.probed`); it says which endpoints'
effective budget changed, so that only those are written to admission.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from routing.hop.scrape import Reading
from routing.registry import AdaptiveConfig, Model

log = logging.getLogger("gateway.health")

# An overloaded reading takes the budget down by a quarter. TCP halves its window; a
# quarter is gentler because the signal is coarse (a queue seen every probe) and an
# overshoot costs little (the worker queues, as it does without a budget). With the
# default min_fraction 0.5 the floor is reached in three readings.
DECREASE = 0.75
# After a decrease, readings for this long cannot decrease it again: requests admitted
# before it still run (and queue) in the worker, so the next probe sees the old load
# (TCP, likewise, decreases once per round trip). Two probes at the default interval.
HOLD_S = 10.0
# A reading that is not overloaded gives back 1 % of the budget per second since the last
# reading: 5 % per probe at the default 5 s interval, from min_fraction 0.5 to the whole
# budget in 50 s. In seconds, not per probe, so that a shorter `health.interval_s` does not
# make it bolder; a gap (probes failing) counts for at most `HOLD_S`.
INCREASE_PER_S = 0.01


def next_fraction(
    fraction: float,
    overloaded: bool,
    *,
    min_fraction: float,
    elapsed_s: float,
    since_decrease_s: float,
) -> float:
    """AIMD: the fraction of its budget an endpoint gets after one reading of its worker,
    `elapsed_s` after the previous one and `since_decrease_s` after the last decrease."""
    if overloaded:
        target = fraction if since_decrease_s < HOLD_S else fraction * DECREASE
    else:
        target = fraction + INCREASE_PER_S * min(max(elapsed_s, 0.0), HOLD_S)
    return max(min_fraction, min(1.0, target))


def overloaded(reading: Reading, adaptive: AdaptiveConfig) -> bool | None:
    """Whether a reading says the worker has more than it can hold; None: it cannot say."""
    if reading.waiting is None and reading.kv_usage is None:
        return None
    waiting = reading.waiting if reading.waiting is not None else 0.0
    kv_usage = reading.kv_usage if reading.kv_usage is not None else 0.0
    return waiting >= adaptive.waiting_threshold or kv_usage >= adaptive.kv_threshold


@dataclass
class Budget:
    """One model's budget on one endpoint."""

    configured: int | None  # None: `auto`
    adaptive: AdaptiveConfig
    fraction: float = 1.0
    read_at: float | None = None  # the last reading that stepped the fraction
    decreased_at: float = -math.inf

    def whole(self, auto: int | None) -> int | None:
        """The budget unadapted: as configured, or the worker's cache as last read."""
        return self.configured if self.configured is not None else auto

    def effective(self, auto: int | None) -> int | None:
        base = self.whole(auto)
        if base is None or not self.adaptive.enabled:
            return base
        # Rounded down; the epsilon keeps float error (2000 x 0.55 is 1099.99...) from
        # taking a token off.
        return max(1, math.floor(base * self.fraction + 1e-6))

    def step(self, reading: Reading, now: float) -> None:
        over = overloaded(reading, self.adaptive)
        if over is None:
            return
        elapsed = now - self.read_at if self.read_at is not None else 0.0
        fraction = next_fraction(
            self.fraction, over, min_fraction=self.adaptive.min_fraction,
            elapsed_s=elapsed, since_decrease_s=now - self.decreased_at,
        )  # fmt: skip
        if fraction < self.fraction:
            self.decreased_at = now
        self.fraction, self.read_at = fraction, now


@dataclass
class Worker:
    """What every budget of one endpoint shares: its KV cache size as last read."""

    budgets: dict[str, Budget] = field(default_factory=dict)  # by model
    kv_tokens: int | None = None
    told_unknown: bool = False

    @property
    def auto(self) -> bool:
        return any(b.configured is None for b in self.budgets.values())

    @property
    def adaptive(self) -> bool:
        return any(b.adaptive.enabled for b in self.budgets.values())


class TokenBudgets:
    """The token budgets of a config's endpoints, by endpoint URL and model."""

    def __init__(self, models: Iterable[Model], clock: Callable[[], float]) -> None:
        self._clock = clock
        self.workers: dict[str, Worker] = {}
        for model in models:
            for e in model.config.endpoints:
                if e.max_tokens_in_flight is None:
                    continue
                configured = None if e.max_tokens_in_flight == "auto" else e.max_tokens_in_flight
                worker = self.workers.setdefault(e.base_url, Worker())
                worker.budgets[model.name] = Budget(configured, model.config.adaptive)

    def adopt(self, previous: TokenBudgets) -> None:
        """A config reload: a known endpoint keeps the size read, and a model's budget that
        adapts on both sides keeps its fraction."""
        for url, known in previous.workers.items():
            mine = self.workers.get(url)
            if mine is None:
                continue
            mine.kv_tokens, mine.told_unknown = known.kv_tokens, known.told_unknown
            for name, budget in mine.budgets.items():
                before = known.budgets.get(name)
                if before is not None and before.adaptive.enabled and budget.adaptive.enabled:
                    budget.fraction, budget.read_at = before.fraction, before.read_at
                    budget.decreased_at = before.decreased_at

    def needs(self, url: str) -> tuple[bool, bool]:
        """What of its worker's /metrics an endpoint's budgets need: its load (some budget
        adapts) and its KV cache's size (some budget is `auto`)."""
        worker = self.workers.get(url)
        return (worker.adaptive, worker.auto) if worker is not None else (False, False)

    def unread(self, url: str) -> bool:
        """Whether the endpoint has an `auto` budget whose KV cache was never read."""
        worker = self.workers.get(url)
        return worker is not None and worker.auto and worker.kv_tokens is None

    def budget(self, model: str, url: str) -> int | None:
        """`model`'s effective budget on the endpoint; None: none (or `auto`, not read yet)."""
        worker = self.workers.get(url)
        budget = worker.budgets.get(model) if worker is not None else None
        return budget.effective(worker.kv_tokens) if budget is not None and worker else None

    def whole(self, model: str, url: str) -> int | None:
        """`model`'s budget on the endpoint before adaptation shrinks it: the most a request
        alone there may reserve (a worker restarted with a smaller cache holds no more)."""
        worker = self.workers.get(url)
        budget = worker.budgets.get(model) if worker is not None else None
        return budget.whole(worker.kv_tokens) if budget is not None and worker else None

    def observe(self, url: str, reading: Reading | None) -> bool:
        """A probe's reading of the endpoint's worker (None: its /metrics could not be
        read); whether any model's effective budget on it changed."""
        worker = self.workers.get(url)
        if worker is None:
            return False
        before = [b.effective(worker.kv_tokens) for b in worker.budgets.values()]
        if reading is not None:
            self._learn(url, worker, reading.kv_tokens)
            now = self._clock()
            for budget in worker.budgets.values():
                if budget.adaptive.enabled:
                    budget.step(reading, now)
        if worker.auto and worker.kv_tokens is None and not worker.told_unknown:
            worker.told_unknown = True
            log.warning(
                "endpoint %s: its token budget is auto, and it has not told its KV cache's "
                "size yet (vLLM: vllm:cache_config_info in /metrics; llama.cpp: n_ctx and "
                "total_slots in /props): requests are counted only",
                url,
            )
        return before != [b.effective(worker.kv_tokens) for b in worker.budgets.values()]

    def _learn(self, url: str, worker: Worker, kv_tokens: int | None) -> None:
        if not worker.auto or kv_tokens is None or kv_tokens == worker.kv_tokens:
            return
        if worker.kv_tokens is None:
            log.info("endpoint %s: KV cache of %d tokens, its auto token budget", url, kv_tokens)
        else:
            log.warning(
                "endpoint %s: KV cache now %d tokens (was %d): its auto token budget follows",
                url, kv_tokens, worker.kv_tokens,
            )  # fmt: skip
        worker.kv_tokens = kv_tokens
