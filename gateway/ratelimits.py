"""A rate-limited key's limits as OpenAI's response headers, on every answer to it (docs/api.md,
rate limits): per limited kind, `x-ratelimit-limit-<kind>` (per minute),
`x-ratelimit-remaining-<kind>` (whole requests or tokens the bucket would take now) and
`x-ratelimit-reset-<kind>` (until the bucket is full again, written as OpenAI does: "1s",
"6m0s", "120ms"). Admission says the values (routing/quotas.py); this is only their text.
"""

from __future__ import annotations

from routing.quotas import Quota, Quotas

Headers = tuple[tuple[bytes, bytes], ...]


def quota_headers(quotas: Quotas | None) -> Headers:
    """The headers of `quotas` (none for a key without limits); what Redis did not say (an
    outage) is left out, the limit stays."""
    if quotas is None:
        return ()
    return _kind(b"requests", quotas.requests) + _kind(b"tokens", quotas.tokens)


def _kind(kind: bytes, quota: Quota | None) -> Headers:
    if quota is None:
        return ()
    found: Headers = ((b"x-ratelimit-limit-" + kind, b"%d" % quota.limit),)
    if quota.remaining is not None:
        found += ((b"x-ratelimit-remaining-" + kind, b"%d" % quota.remaining),)
    if quota.reset_ms is not None:
        found += ((b"x-ratelimit-reset-" + kind, duration(quota.reset_ms).encode("ascii")),)
    return found


def duration(ms: int) -> str:
    """A duration as OpenAI's headers write it (Go's): "0s", "120ms", "1.5s", "6m0s",
    "1h2m3s"; milliseconds at most."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest // 1000}.{rest % 1000:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{seconds}"
    return f"{minutes}m{seconds}" if minutes else seconds
