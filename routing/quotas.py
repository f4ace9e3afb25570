"""What a rate-limited request's answer reports of its limits, as plain values: per kind
(requests, tokens) the limit per minute, what is left and when the bucket is full again.
The edge writes them as OpenAI's `x-ratelimit-*` headers (gateway/ratelimits.py); admission
fills them (routing/admission/ratelimit.py), on its answers and on its errors alike.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Quota:
    """One kind of limit: `limit` per minute; `remaining` whole requests (or tokens) the
    bucket would take now, and `reset_ms` until it is full again (None: not known, Redis
    did not answer)."""

    limit: int
    remaining: int | None = None
    reset_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Quotas:
    """A request's limits by kind; None for a kind without a limit."""

    requests: Quota | None = None
    tokens: Quota | None = None
