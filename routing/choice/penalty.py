"""A worker's own load signal as a penalty on its score (routing/choice/load.py): read from
its /metrics by the health probes (routing/hop/health.py)."""

from __future__ import annotations


def penalty(waiting: float | None, kv_usage: float | None, size: int) -> float:
    """Queued requests wait behind running ones (up to 2, by the queue relative to the
    endpoint's size); a full KV cache preempts (up to 1, by its use). Both count."""
    queued = max(0.0, waiting or 0.0) / max(1, size)
    return min(2.0, queued) + min(1.0, max(0.0, kv_usage or 0.0))
