"""The gateway's one exception tree, and the only place status codes are decided.

Every error a caller can see is a `GatewayError`: it carries the HTTP status and the
OpenAI error envelope fields. The gateway's own modules raise these; routing raises its own
errors as data (routing/errors.py), which `from_routing` translates here, once, where the
gateway catches them. No Starlette here.
"""

from __future__ import annotations

from typing import Any

from routing.errors import (
    Limited,
    LimitReason,
    RoutingError,
    TooLarge,
    Unavailable,
    UnavailableReason,
    UnknownModel,
    WorkerBrokeOff,
    WorkerFailed,
    WorkerTimeout,
    WorkerUnreachable,
)


class GatewayError(Exception):
    """Base class: an error with an HTTP status and an OpenAI-style envelope."""

    status: int = 500
    type: str = "api_error"
    code: str = "internal_error"
    # The configured model the error concerns, once known (a metric label; never caller text).
    model: str = ""

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param
        self.headers = headers or {}

    def envelope(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class AuthenticationFailed(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"

    def __init__(self, message: str = "Invalid or missing API key.") -> None:
        super().__init__(message, headers={"www-authenticate": "Bearer"})


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model")


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class EncodingUnsupported(GatewayError):
    """A request body in a `Content-Encoding` the gateway does not decode (`param`: the header)."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"


class CorsRefused(GatewayError):
    """A browser's preflight from an origin, or asking a method or headers, not allowed."""

    status = 403
    type = "invalid_request_error"
    code = "cors_not_allowed"


class HeaderInvalid(GatewayError):
    """A request header the gateway reads holds a value it cannot use (`param`: its name)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class RequestInvalid(GatewayError):
    """A body that does not match the schema. Rendered as the seeds' HTTPValidationError."""

    status = 422
    type = "invalid_request_error"
    code = "invalid_request"

    def __init__(self, detail: list[dict[str, Any]]) -> None:
        first = detail[0] if detail else {"loc": ["body"], "msg": "invalid body", "type": ""}
        field = _field(first)
        super().__init__(f"{field or 'body'}: {first['msg']}", param=field)
        self.detail = detail


class RateLimited(GatewayError):
    """No capacity for this caller now; `Retry-After` says when to try again."""

    status = 429
    type = "rate_limit_error"

    def __init__(
        self, message: str, *, code: LimitReason, retry_after_s: int, retryable: bool = True
    ) -> None:
        headers = {"retry-after": str(max(1, retry_after_s))}
        if not retryable:  # larger than a limit: no retry can fix it (the SDK's own header)
            headers["x-should-retry"] = "false"
        super().__init__(message, code=LimitReason(code).value, headers=headers)
        self.retry_after_s = max(1, retry_after_s)


class ContextTooLarge(GatewayError):
    """The request needs more of a worker's KV cache (its prompt and its answer) than any
    endpoint of its models holds: it could never be served, so it is not queued."""

    status = 400
    type = "invalid_request_error"
    code = "context_too_large"


class WorkerRejected(GatewayError):
    """The worker's own 4xx (e.g. prompt too long): passed through with its status."""

    type = "invalid_request_error"
    code = "invalid_request"

    def __init__(self, status: int, message: str, *, code: str | None, param: str | None) -> None:
        super().__init__(message, code=code or "invalid_request", param=param)
        self.status = status


class InternalError(GatewayError):
    """A failure nobody foresaw (a bug): the last-resort answer, without details."""

    status = 500
    type = "api_error"
    code = "internal_error"

    def __init__(self) -> None:
        super().__init__(
            "The gateway failed while handling this request; "
            "the failure is logged under this request id."
        )


class UpstreamFailed(GatewayError):
    """The worker failed or answered garbage (502)."""

    status = 502
    type = "api_error"
    code = "upstream_error"


class UpstreamUnavailable(UpstreamFailed):
    """The worker could not be reached (connection refused, reset before an answer)."""

    code = "upstream_unavailable"


class UpstreamBroken(UpstreamFailed):
    """The worker's answer broke off after it had started (mid-stream failure)."""

    code = "upstream_stream_broken"


class ServiceUnavailable(GatewayError):
    """Nothing can serve: no healthy endpoint, store down under on_outage=reject, shutdown.
    No `Retry-After`: nobody can tell when it ends."""

    status = 503
    type = "api_error"
    code = "service_unavailable"

    def __init__(self, message: str, *, reason: UnavailableReason) -> None:
        shutting_down = reason is UnavailableReason.SHUTTING_DOWN
        super().__init__(message, code=reason.value if shutting_down else None)
        self.reason = reason


class UpstreamTimeout(GatewayError):
    status = 504
    type = "api_error"
    code = "upstream_timeout"


# Worker failures, one class each (its name is the `kind` label of gateway_upstream_errors).
_WORKER: dict[type[RoutingError], type[GatewayError]] = {
    WorkerUnreachable: UpstreamUnavailable,
    WorkerBrokeOff: UpstreamBroken,
    WorkerFailed: UpstreamFailed,
    WorkerTimeout: UpstreamTimeout,
}


def from_routing(exc: RoutingError) -> GatewayError:
    """Routing's error as the caller's answer: the one place its status, code and
    `Retry-After` are decided (429 per limit reason, 503 per unavailable reason)."""
    error: GatewayError
    if isinstance(exc, Limited):
        error = RateLimited(
            exc.message, code=exc.reason, retry_after_s=exc.retry_after_s, retryable=exc.retryable
        )
    elif isinstance(exc, Unavailable):
        error = ServiceUnavailable(exc.message, reason=exc.reason)
    elif isinstance(exc, UnknownModel):
        error = ModelNotFound(exc.message)
    elif isinstance(exc, TooLarge):
        # It never fits: the OpenAI SDK would retry it otherwise (x-should-retry says no).
        error = ContextTooLarge(
            exc.message, param="max_tokens", headers={"x-should-retry": "false"}
        )
    else:
        # The nearest mapped class: a new kind of worker failure answers as its parent does.
        kind = next((_WORKER[c] for c in type(exc).__mro__ if c in _WORKER), InternalError)
        error = kind(exc.message)
    error.model = exc.model
    return error


def _field(error: dict[str, Any]) -> str | None:
    """The field an error names, dotted (`messages.0.content`); None for the body as a whole
    or a JSON syntax error, whose `loc` holds a position, not a field."""
    loc = list(error["loc"])
    if error.get("type") == "json_invalid":
        return None
    if loc and loc[0] == "body":
        loc = loc[1:]
    return ".".join(str(part) for part in loc) or None
