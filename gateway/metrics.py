"""Every Prometheus metric of docs/metrics.md, declared once, in a registry per app.

Label values come only from config (model names, endpoint urls, tier names) or from fixed
sets (status codes, 429 reasons), never from request text, so cardinality stays bounded.

Under `serve --workers N` every worker process writes its metrics into one directory
(prometheus-client's multiprocess mode, `share_across_processes`), and a scrape of any of
them sums the files of all: counters and histograms add up (those of a dead worker stay),
gauges follow the mode declared with them (`livesum` for what each process holds,
`livemostrecent` for views every process shares). A single process keeps its values in
memory, as prometheus-client does by default.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    values,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from routing.background import TASKS

# LLM requests last from milliseconds (a 429) to many minutes (a long stream).
DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Queue waits: from a few ms to a tier's longest queue timeout.
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Gauges of a view every process has of the same thing (the fleet, an endpoint's health):
# the value last set by any live process. Each process sets them again before it renders.
SHARED_VIEW: Final = "livemostrecent"
_shared_dir: str | None = None
# Labelled children kept per family by `Children`: far above the series config can make
# (models x tiers x codes), small in memory; past it the cache starts over.
MAX_CHILDREN = 4096

FamilyT = TypeVar("FamilyT", Counter, Histogram)


class LoopValue:
    """prometheus-client's value class for a process whose metrics change on one thread
    (the event loop's: the gateway starts no other): its `MutexValue` without the lock
    taken on every change (7 changes per answered request). `share_across_processes`
    replaces it with the shared files' class in the workers of `serve --workers`."""

    _multiprocess = False

    def __init__(self, *_: Any, **__: Any) -> None:
        self._value = 0.0
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> Any:
        return self._exemplar


values.ValueClass = LoopValue


def share_across_processes(directory: str) -> None:
    """From now on, this process's metrics live in `directory`, beside those of the other
    workers of one `serve --workers N`. Called in each worker right after its fork, before
    any metric is made (the value class is chosen when a metric is)."""
    global _shared_dir
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # where prometheus-client writes
    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    _shared_dir = directory


class Metrics:
    """The families, declared by concern; registration order is the /metrics order."""

    def __init__(self, background_errors: Mapping[str, int] | None = None) -> None:
        # No `_created` twin per counter and histogram: it doubles the series and no
        # dashboard reads it. A process-wide switch of prometheus_client, set here with the
        # registry so that every /metrics this process renders is without them.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream
        self.registry = CollectorRegistry(auto_describe=True)
        self.shared_dir = _shared_dir
        self._scrape = self.registry
        if self.shared_dir is not None:
            self._scrape = CollectorRegistry()
            MultiProcessCollector(self._scrape, self.shared_dir)  # type: ignore[no-untyped-call]
        # Counts kept elsewhere, read at scrape time (`publish` writes them when shared).
        self._background_errors = background_errors if background_errors is not None else {}
        self._published: dict[tuple[str, str], int] = {}
        self._shared_counts: dict[tuple[str, str], Counter] = {}
        self._shared_reads: dict[str, Callable[[], int]] = {}
        self._declare_background(self.registry)
        self._declare_traffic(self.registry)
        self._declare_admission(self.registry)
        self._declare_waits(self.registry)
        self._declare_workers(self.registry)
        self._declare_spool(self.registry)
        self._declare_fleet(self.registry)

    def _declare_traffic(self, r: CollectorRegistry) -> None:
        """What callers got: answers, their durations, tokens."""
        self.requests = Counter(
            "gateway_requests", "Requests answered, by served model, applied tier and status.",
            ["model", "tier", "code"], registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "gateway_request_duration_seconds", "Time from request to the last byte sent.",
            ["model", "tier"], buckets=DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds", "Time from request to the first streamed byte.",
            ["model", "tier"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "gateway_tokens", "Tokens processed, from the workers' usage.",
            ["model", "tier", "kind"], registry=r,
        )  # fmt: skip
        # The hot path's children, looked up once per label values (`labels` checks and
        # converts every value and takes a lock on each call).
        self.requests_of = Children(self.requests)
        self.duration_of = Children(self.duration)
        self.ttft_of = Children(self.ttft)
        self.tokens_of = Children(self.tokens)
        self._served: dict[tuple[str, str], Served] = {}

    def served(self, model: str, tier: str) -> Served:
        """An answered request's children of one model and tier, looked up once (at most
        MAX_CHILDREN pairs kept, then the cache starts over, as `Children`)."""
        found = self._served.get((model, tier))
        if found is None:
            if len(self._served) >= MAX_CHILDREN:
                self._served.clear()
            found = self._served[(model, tier)] = Served(self, model, tier)
        return found

    def _declare_admission(self, r: CollectorRegistry) -> None:
        """Slots and queues: who waits, who holds, who was turned away or fell back."""
        self.queue_depth = Gauge(
            "gateway_queue_depth", "Requests waiting for a slot.", ["model", "tier"],
            registry=r, multiprocess_mode=SHARED_VIEW,
        )  # fmt: skip
        self.inflight = Gauge(
            "gateway_inflight", "Requests holding a slot.", ["model"],
            registry=r, multiprocess_mode=SHARED_VIEW,
        )  # fmt: skip
        self.capacity = Gauge(
            "gateway_capacity", "Slots of healthy endpoints.", ["model"],
            registry=r, multiprocess_mode=SHARED_VIEW,
        )  # fmt: skip
        self.tokens_reserved = Gauge(
            "gateway_tokens_reserved",
            "Tokens of an endpoint's KV-cache budget its requests in flight reserve (endpoints "
            "with a budget; read from Redis every few seconds).",
            ["model", "endpoint"], registry=r, multiprocess_mode=SHARED_VIEW,
        )  # fmt: skip
        self.rejections = Counter(
            "gateway_rejections", "429 answers, by reason (the error code).",
            ["model", "tier", "reason"], registry=r,
        )  # fmt: skip
        self.fallbacks = Counter(
            "gateway_fallbacks", "Requests served by a later entry of their models list.",
            ["from_model", "to_model"], registry=r,
        )  # fmt: skip

    def _declare_waits(self, r: CollectorRegistry) -> None:
        """How long a request would wait (deadlines), and flex requests preempted."""
        self.preemptions = Counter(
            "gateway_preemptions", "Flex requests preempted before their first byte, by "
            "what became of them (rejected: a 429 preempted; requeued).", ["model", "outcome"],
            registry=r,
        )  # fmt: skip
        self.wait_estimate = Histogram(
            "gateway_wait_estimate_seconds",
            "The wait admission estimated for a request that would queue (its turn / the "
            "model's service rate): queued, or refused at once for its deadline.",
            ["model", "tier"], registry=r, buckets=WAIT_BUCKETS,
        )  # fmt: skip
        self.wait_estimate_error = Histogram(
            "gateway_wait_estimate_error_seconds", "How far a queued request's actual wait was "
            "from the estimate (absolute).", ["model", "tier"], registry=r, buckets=WAIT_BUCKETS,
        )  # fmt: skip

    def _declare_workers(self, r: CollectorRegistry) -> None:
        """The hop to workers: its failures, which endpoints are in rotation and the token
        budget admission holds each to."""
        self.upstream_errors = Counter(
            "gateway_upstream_errors", "Failures talking to workers.",
            ["model", "endpoint", "kind"], registry=r,
        )  # fmt: skip
        self.endpoint_up = Gauge(
            "gateway_endpoint_up", "1 while an endpoint is in rotation.",
            ["model", "endpoint"], registry=r, multiprocess_mode=SHARED_VIEW,
        )  # fmt: skip
        self.token_budget = Gauge(
            "gateway_token_budget",
            "A model's token budget on an endpoint, after adaptation (NaN: auto, not read yet).",
            ["model", "endpoint"], registry=r, multiprocess_mode=SHARED_VIEW,
        )  # fmt: skip

    def _declare_spool(self, r: CollectorRegistry) -> None:
        """Beyond traffic: the billing safety net. Records waiting in this process's spool for
        Redis, those lost because the spool was full or unwritable (each also logged), and
        unreadable spool lines set aside (torn by a kill or a full disk)."""
        self.usage_spooled = Gauge(
            "gateway_usage_spool_bytes", "Usage records waiting on disk for Redis.",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        # Read at scrape time from the spool's own count (GatewayState.render_metrics).
        self.usage_lost = 0
        self._total(
            r, "gateway_usage_records_lost", "Usage records this process could not keep.",
            lambda: self.usage_lost,
        )  # fmt: skip
        self.usage_bad_lines = 0
        self._total(
            r, "gateway_usage_spool_bad_lines", "Unreadable spool lines this process set aside.",
            lambda: self.usage_bad_lines,
        )  # fmt: skip

    def _declare_fleet(self, r: CollectorRegistry) -> None:
        """Beyond traffic: the fleet as this replica last saw it (its `on_outage: local` share
        is the capacity divided among these), and docs/usage.md's stream `usage`
        (fleet-wide: every replica shows the same) as of the last spool round, after
        trimming to usage.retention_days."""
        self.replicas = Gauge(
            "gateway_replicas", "Live gateway replicas, as this one's last sweep saw them.",
            registry=r, multiprocess_mode=SHARED_VIEW,
        )  # fmt: skip
        self.usage_stream_length = Gauge(
            "gateway_usage_stream_length", "Entries in the Redis stream `usage`.",
            registry=r, multiprocess_mode=SHARED_VIEW,
        )  # fmt: skip
        self.usage_stream_oldest_age = Gauge(
            "gateway_usage_stream_oldest_age_seconds",
            "Age of the oldest entry of the Redis stream `usage`.",
            registry=r, multiprocess_mode=SHARED_VIEW,
        )  # fmt: skip

    def _declare_background(self, r: CollectorRegistry) -> None:
        """Counted where the loops run (routing/background.py)."""
        if self.shared_dir is None:
            r.register(_BackgroundErrors(self._background_errors))
            return
        family = Counter(
            "gateway_background_errors",
            "Background rounds (sweep, spool, health, reload, ...) that failed and were retried.",
            ["task"], registry=r,
        )  # fmt: skip
        self._shared_counts.update({("background", t): family.labels(t) for t in TASKS})

    def _total(self, r: CollectorRegistry, name: str, doc: str, read: Callable[[], int]) -> None:
        """A counter kept elsewhere: read at scrape time, or when shared, a counter that
        `publish` brings up to date."""
        if self.shared_dir is None:
            r.register(_Total(name, doc, read))
        else:
            self._shared_counts[(name, "")] = Counter(name, doc, registry=r)
            self._shared_reads[name] = read

    def publish(self) -> None:
        """When shared: write the counts kept elsewhere into this process's files, so that a
        scrape served by another worker sees them (called before each render, every second
        and at the end)."""
        if self.shared_dir is None:
            return
        for (name, label), counter in self._shared_counts.items():
            value = self._background_errors.get(label, 0)
            if name != "background":
                value = self._shared_reads[name]()
            if (delta := value - self._published.get((name, label), 0)) > 0:
                counter.inc(delta)
                self._published[(name, label)] = value

    def render(self) -> bytes:
        self.publish()
        return generate_latest(self._scrape)


class Served:
    """The children an answered request of one model and tier changes: its code's request
    count, its duration, and (made when first needed, as `labels` would) its time to the
    first byte and its tokens."""

    __slots__ = ("_codes", "_metrics", "_model", "_tier", "_tokens", "_ttft", "duration")

    def __init__(self, metrics: Metrics, model: str, tier: str) -> None:
        self._metrics = metrics
        self._model, self._tier = model, tier
        self._codes: dict[int, Counter] = {}
        self.duration = metrics.duration_of(model, tier)
        self._ttft: Histogram | None = None
        self._tokens: tuple[Counter, Counter] | None = None

    def answered(self, status: int, duration_s: float, ttft_s: float | None) -> None:
        child = self._codes.get(status)
        if child is None:  # HTTP status codes: a bounded set
            child = self._codes[status] = self._metrics.requests_of(
                self._model, self._tier, str(status)
            )
        child.inc()
        self.duration.observe(duration_s)
        if ttft_s is not None:
            if self._ttft is None:
                self._ttft = self._metrics.ttft_of(self._model, self._tier)
            self._ttft.observe(ttft_s)

    def tokens(self, prompt: int, completion: int) -> None:
        if self._tokens is None:
            of = self._metrics.tokens_of
            self._tokens = (
                of(self._model, self._tier, "prompt"), of(self._model, self._tier, "completion")
            )  # fmt: skip
        self._tokens[0].inc(prompt)
        self._tokens[1].inc(completion)


class Children(Generic[FamilyT]):
    """A family's labelled children, cached by their label values (at most `limit`, then
    the cache starts over: the family itself keeps every child, so a value is never lost).
    Families are never pruned of children (no `remove`), so a cached child stays theirs."""

    __slots__ = ("_cache", "_family", "_limit")

    def __init__(self, family: FamilyT, limit: int = MAX_CHILDREN) -> None:
        self._family: FamilyT = family
        self._limit = limit
        self._cache: dict[tuple[str, ...], FamilyT] = {}

    def __call__(self, *values: str) -> FamilyT:
        child = self._cache.get(values)
        if child is None:
            if len(self._cache) >= self._limit:
                self._cache.clear()
            child = self._cache[values] = self._family.labels(*values)
        return child

    def __len__(self) -> int:
        return len(self._cache)


class _BackgroundErrors(Collector):
    """`gateway_background_errors_total{task}`: rounds of a background task that failed."""

    def __init__(self, counts: Mapping[str, int]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "gateway_background_errors",
            "Background rounds (sweep, spool, health, reload, ...) that failed and were retried.",
            labels=["task"],
        )
        for task in TASKS:
            family.add_metric([task], self._counts.get(task, 0))
        yield family

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "gateway_background_errors", "Background rounds that failed.", labels=["task"]
        )


class _Total(Collector):
    """A counter whose value lives elsewhere (a count kept by routing/), read at scrape time."""

    def __init__(self, name: str, documentation: str, read: Callable[[], int]) -> None:
        self._name = name
        self._documentation = documentation
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation)
        family.add_metric([], self._read())
        yield family

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._documentation)
