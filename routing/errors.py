"""Routing's own errors: what went wrong, as data. No HTTP here.

Admission, the fallback plan and the hop to workers raise these; the edge translates them
once into the caller's answer (gateway/errors.py `from_routing`: status, OpenAI envelope,
`Retry-After`). The reasons a request is turned away are named here and nowhere else:
adding one is an edit of its enum and of the mapping's test (tests/gateway/test_errors.py).
"""

from __future__ import annotations

from enum import StrEnum

from routing.quotas import Quotas


class LimitReason(StrEnum):
    """Why a caller gets no capacity now (a 429). The value is the error's `code` and the
    `reason` label of `gateway_rejections_total`; the Lua scripts answer with statuses
    (routing/admission/slots.py), which routing/admission/admit.py turns into these."""

    MODEL_BUSY = "model_busy"
    FLEX_NO_CAPACITY = "flex_no_capacity"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    CONCURRENCY_LIMIT = "concurrency_limit"
    RATE_LIMIT_REQUESTS = "rate_limit_requests"
    RATE_LIMIT_TOKENS = "rate_limit_tokens"
    DEADLINE_UNREACHABLE = "deadline_unreachable"
    PREEMPTED = "preempted"


class UnavailableReason(StrEnum):
    """Why nothing can serve (a 503, docs/api.md "503 reasons"). The caller sees the code
    `shutting_down` for the last one and `service_unavailable` for all others."""

    NO_HEALTHY_ENDPOINT = "no_healthy_endpoint"
    STORE_UNREACHABLE = "store_unreachable"
    NO_LOCAL_SHARE = "no_local_share"
    KEY_STORE_UNREACHABLE = "key_store_unreachable"
    NO_KNOWN_ENDPOINT = "no_known_endpoint"
    SHUTTING_DOWN = "shutting_down"


class RoutingError(Exception):
    """Base class: a message for the caller (never request text beyond bounded names)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        # The configured model the error concerns, once known (a metric label).
        self.model = ""
        # A rate-limited key's limits as they stand (its answer's x-ratelimit-* headers).
        self.quotas: Quotas | None = None


class UnknownModel(RoutingError):
    """None of the requested models exists or is allowed to the key."""


class Limited(RoutingError):
    """No capacity for this caller now; a slot is likely free in `retry_after_s`. Not
    `retryable`: this request can never be served as it is (larger than a limit)."""

    def __init__(
        self, message: str, reason: LimitReason, retry_after_s: int, *, retryable: bool = True
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.retryable = retryable
        # The wait admission estimated for it, where it would have queued (a metric).
        self.wait_estimate_s: float | None = None


class Preempted(Limited):
    """A flex request's slot was taken by a request of a tier that may preempt, before its
    first byte went to its caller: a 429 `preempted` (unless it is queued again)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, LimitReason.PREEMPTED, retry_after_s)


class TooLarge(RoutingError):
    """The request's token reservation exceeds every candidate endpoint's whole budget: no
    queue could ever serve it."""

    def __init__(self, message: str, needed: int, budget: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.budget = budget


class Unavailable(RoutingError):
    """Nothing can serve this request now."""

    def __init__(self, message: str, reason: UnavailableReason) -> None:
        super().__init__(message)
        self.reason = reason


class WorkerFailed(RoutingError):
    """The worker failed or answered garbage."""


class WorkerUnreachable(WorkerFailed):
    """The worker could not be reached (connection refused, reset before an answer)."""


class WorkerBrokeOff(WorkerFailed):
    """The worker's answer broke off after it had started (mid-stream failure)."""


class WorkerTimeout(RoutingError):
    """The worker did not answer in time, or fell silent."""
