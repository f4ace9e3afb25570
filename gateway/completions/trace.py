"""W3C trace context (`traceparent`, `tracestate`) passed from the caller to the worker.

The gateway opens no span of its own: it forwards the caller's context unchanged, so one trace
(and, with `x-request-id`, one id) follows a request from the client to the GPU. Only values
it can vouch for leave: a well-formed, bounded header goes on, anything else is dropped.
"""

from __future__ import annotations

import re

# version-traceid-parentid-flags, lowercase hex. A future version may append fields after a
# '-'; "ff" is never a version, and an all-zero trace or parent id is invalid.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-[!-~]*)?")
MAX_TRACEPARENT = 256
# The W3C spec asks to pass on at least 512 characters and 32 list members; longer is dropped
# (not cut: a cut member would be ill-formed).
MAX_TRACESTATE = 512
MAX_TRACESTATE_MEMBERS = 32
_KEY = r"(?:[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13}|[a-z][_0-9a-z\-*/]{0,255})"
_VALUE = r"[ -+\--<>-~]{0,255}[!-+\--<>-~]"
_MEMBER = re.compile(rf"[ \t]*{_KEY}={_VALUE}[ \t]*")


def valid_traceparent(value: str) -> bool:
    if len(value) > MAX_TRACEPARENT:
        return False
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return False
    version, trace_id, parent_id, more = match.groups()
    return (
        version != "ff"
        and (version != "00" or more is None)
        and trace_id != "0" * 32
        and parent_id != "0" * 16
    )


def valid_tracestate(value: str) -> bool:
    if len(value) > MAX_TRACESTATE:
        return False
    # Empty members (",,") are allowed by the spec and carry nothing.
    members = [m for m in value.split(",") if m.strip(" \t")]
    return len(members) <= MAX_TRACESTATE_MEMBERS and all(
        _MEMBER.fullmatch(m) is not None for m in members
    )


def trace_headers(traceparent: str | None, tracestate: str | None) -> dict[str, str]:
    """The caller's trace context to forward: `traceparent` if well-formed, `tracestate`
    only beside it (the spec: no tracestate without a valid traceparent)."""
    if traceparent is None or not valid_traceparent(traceparent):
        return {}
    headers = {"traceparent": traceparent}
    if tracestate and valid_tracestate(tracestate):
        headers["tracestate"] = tracestate
    return headers
