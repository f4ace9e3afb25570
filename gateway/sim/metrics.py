"""The simulated worker's /metrics (gateway/sim/worker.py): vLLM's names, on a registry of
the app's own, read from its slots when scraped."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from gateway.sim.load import Slots

FINISH_REASONS = ("stop", "length", "abort")


class SimMetrics:
    """vLLM's metric names, on a registry of this app's own."""

    def __init__(
        self, models: tuple[str, ...], kv_blocks: int | None, block_size: int, slots: Slots
    ) -> None:
        self.registry = CollectorRegistry()
        budget = slots.budget
        usage = (lambda: slots.tokens / budget) if budget else (lambda: slots.running / slots.size)
        gauges: tuple[tuple[str, str, Callable[[], float]], ...] = (
            ("vllm:num_requests_running", "Requests generating now.", lambda: slots.running),
            ("vllm:num_requests_waiting", "Requests waiting for a slot.", lambda: slots.waiting),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage: tokens of the running requests / the cache (without one, "
                "running / max_seqs). 1 means 100 percent.",
                usage,
            ),
            ("sim:peak_tokens_running", "Most tokens ever held by running requests.",
             lambda: slots.peak_tokens),
            ("sim:peak_requests_running", "Most requests ever running at once.",
             lambda: slots.peak_running),
            ("sim:peak_requests_waiting", "Most requests ever waiting at once.",
             lambda: slots.peak_waiting),
        )  # fmt: skip
        for name, doc, read in gauges:
            gauge = Gauge(name, doc, ["model_name"], registry=self.registry)
            gauge.labels(models[0]).set_function(read)
        if kv_blocks is not None:  # as vLLM: its cache's shape in labels, value 1
            info = Gauge("vllm:cache_config_info", "Information of the KV cache config.",
                         ["block_size", "num_gpu_blocks"], registry=self.registry)  # fmt: skip
            info.labels(str(block_size), str(kv_blocks)).set(1)
        success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason (abort: the client went away).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._success = {(m, r): success.labels(m, r) for m in models for r in FINISH_REASONS}

    def finished(self, model: str, reason: str) -> None:
        self._success[(model, reason)].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
