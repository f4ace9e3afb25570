"""The 429s of admission (docs/api.md, 429 reasons): why a candidate turned a request away,
with the message the caller reads. The Retry-After comes from routing/admission/estimate.py."""

from __future__ import annotations

from routing.admission.replies import Attempt
from routing.admission.slots import BUSY, FULL, PAST_DEADLINE
from routing.errors import Limited, LimitReason
from tiers.policy import Tier


def rejection(model: str, tier: Tier, result: Attempt, retry_after_s: int) -> Limited:
    """A candidate's acquire that neither granted nor queued (`result` BUSY, FULL or
    PAST_DEADLINE)."""
    if result.status == PAST_DEADLINE:
        message = (
            f"The wait for a slot of {model!r} ({result.turn} requests likely go first) "
            "would pass this request's deadline (x-request-timeout)."
        )
        return Limited(message, LimitReason.DEADLINE_UNREACHABLE, retry_after_s=retry_after_s)
    if result.status == FULL:
        message = f"The queue of {model!r} is full ({result.ahead} waiting)."
        return Limited(message, LimitReason.QUEUE_FULL, retry_after_s=retry_after_s)
    assert result.status == BUSY
    busy = LimitReason(tier.busy_reason)
    if busy is not LimitReason.MODEL_BUSY:
        message = f"No spare capacity on {model!r} for the {tier} tier."
        return Limited(message, busy, retry_after_s=retry_after_s)
    message = f"{model!r} has no free slot ({result.inflight} in flight)."
    return Limited(message, busy, retry_after_s=retry_after_s)


def queue_timeout(model: str, timeout_s: float, retry_after_s: int) -> Limited:
    return Limited(
        f"Waited {timeout_s:g}s in the queue of {model!r} without a free slot.",
        LimitReason.QUEUE_TIMEOUT,
        retry_after_s=retry_after_s,
    )


def deadline_passed(model: str, deadline_s: float, retry_after_s: int) -> Limited:
    """A queued request whose own deadline passed before a slot freed."""
    return Limited(
        f"No slot of {model!r} freed within this request's deadline ({deadline_s:g}s, "
        "x-request-timeout).",
        LimitReason.DEADLINE_UNREACHABLE,
        retry_after_s=retry_after_s,
    )


def account_full(account: str, limit: int) -> Limited:
    """The account already has `limit` requests in flight."""
    return Limited(
        f"Account {account[:64]!r} has {limit} requests in flight.",
        LimitReason.CONCURRENCY_LIMIT,
        retry_after_s=1,
    )
