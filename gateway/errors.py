"""The gateway's one exception tree, and the only place status codes are decided.

Every error a caller can see is a `GatewayError`: it carries the HTTP status and the
OpenAI error envelope fields. Lower layers (routing, tiers, upstream) raise these, translated
from aiohttp/redis errors at their own boundary; the edge renders them. No Starlette here, so
routing can import it.
"""

from __future__ import annotations

from typing import Any


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

    def __init__(self, message: str, *, code: str, retry_after_s: int) -> None:
        super().__init__(message, code=code, headers={"retry-after": str(max(1, retry_after_s))})
        self.retry_after_s = max(1, retry_after_s)


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
    """Nothing can serve: no healthy endpoint, store down under on_outage=reject, shutdown."""

    status = 503
    type = "api_error"
    code = "service_unavailable"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "api_error"
    code = "upstream_timeout"


def _field(error: dict[str, Any]) -> str | None:
    """The field an error names, dotted (`messages.0.content`); None for the body as a whole
    or a JSON syntax error, whose `loc` holds a position, not a field."""
    loc = list(error["loc"])
    if error.get("type") == "json_invalid":
        return None
    if loc and loc[0] == "body":
        loc = loc[1:]
    return ".".join(str(part) for part in loc) or None
