"""The access log (`--access-log`): one line per request, as the edge saw it.

`AccessLog` wraps the whole app. It puts an `AccessNote` in the request's scope; the
completion routes fill in what only they know (the model and tier that served it, the
status the usage record holds, queue time, time to first byte) and the line is written
once the answer has ended. A line holds ids, names, statuses and durations: never a key,
a prompt or a completion.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from gateway.edge.asgi import Message, Receive, Scope, Send
from gateway.edge.logs import ACCESS_LOGGER

NOTE = "gateway.access"  # the scope key of the AccessNote
MAX_PATH = 200

log = logging.getLogger(ACCESS_LOGGER)


@dataclass(slots=True)
class AccessNote:
    """What the completion routes add to a request's line (None: not known)."""

    request_id: str | None = None
    model: str | None = None  # the model that served it (after fallbacks)
    tier: str | None = None  # the tier applied
    status: int | None = None  # what the caller got, as the usage record says
    queue_ms: float | None = None
    ttft_ms: float | None = None


class AccessLog:
    """ASGI middleware writing one `gateway.access` line per HTTP request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        note = AccessNote()
        scope[NOTE] = note
        answered: dict[str, Any] = {}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                answered["status"] = message["status"]
                answered["rid"] = _header(message.get("headers", ()), b"x-request-id")
            await send(message)

        failed = False
        try:
            await self.app(scope, receive, sending)
        except BaseException:
            failed = True
            raise
        finally:
            _write(scope, note, answered, failed, started)


def _write(
    scope: Scope, note: AccessNote, answered: dict[str, Any], failed: bool, started: float
) -> None:
    # No answer at all: the server failed (500) or the caller left first (499, as nginx).
    status = note.status or answered.get("status") or (500 if failed else 499)
    method, path = scope["method"], _printable(scope["path"][:MAX_PATH])
    fields = {
        "request_id": note.request_id or answered.get("rid"),
        "method": method,
        "path": path,
        "model": note.model,
        "tier": note.tier,
        "status": status,
        "duration_ms": round((time.perf_counter() - started) * 1000, 3),
        "queue_ms": note.queue_ms,
        "ttft_ms": note.ttft_ms,
    }
    extra = {"fields": fields, "in_message": ("method", "path", "status")}
    log.info("%s %s %d", method, path, status, extra=extra)


def _header(headers: Any, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def _printable(text: str) -> str:
    """A path as one token: control characters escaped, spaces as %20 (a log line cannot
    be forged)."""
    if text.isprintable() and " " not in text:
        return text
    return "".join(
        "%20" if c == " " else c if c.isprintable() else c.encode("unicode_escape").decode()
        for c in text
    )
