"""How a request's answer ends when it cannot end as the worker's answer: a failure nobody
foresaw (a 500, or an SSE error event ending a started stream), the server's shutdown
cutting it short (a 503 `shutting_down`). Used by gateway/completions/route.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import traceback
from pathlib import Path

from gateway.completions.answer import error_event
from gateway.completions.exchange import Exchange
from gateway.edge.asgi import Reply, send_error
from gateway.errors import GatewayError, InternalError, ServiceUnavailable
from gateway.ratelimits import Headers
from routing.errors import UnavailableReason

log = logging.getLogger("gateway.route")


async def crashed(
    exc: Exception, rid: str, reply: Reply, stream: bool, headers: Headers = ()
) -> bool:
    """The answer to a failure nobody foresaw, however far the answer had got: a 500 before
    it started, an SSE error event and the end of a started stream. True if it was sent."""
    # The type and the place only: an exception's text may quote the body.
    log.error("request %s failed: unexpected %s at %s", rid, type(exc).__name__, _where(exc))
    return await end_with(InternalError(), rid, reply, stream, headers)


async def cut_short(rid: str, exchange: Exchange, reply: Reply) -> None:
    """The server cancelled the request: its graceful shutdown ran out of time. The caller
    is told so (a 503 `shutting_down`, or an SSE error event ending a started stream)
    rather than cut off, and the record says what it got."""
    uncancel()
    exchange.finished = True
    error = shut_down()
    if not reply.ended:
        exchange.status = error.status
    await end_with(error, rid, reply, exchange.stream, exchange.headers)


def uncancel() -> None:
    """The cancel is answered here: the request ends normally."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def shut_down() -> ServiceUnavailable:
    return ServiceUnavailable(
        "The gateway shut down before the answer was complete.",
        reason=UnavailableReason.SHUTTING_DOWN,
    )


async def end_with(
    error: GatewayError, rid: str, reply: Reply, stream: bool, headers: Headers = ()
) -> bool:
    """`error` as the end of the answer, however far it had got. True if it was sent."""
    if reply.ended:
        return False
    try:
        if not reply.started:
            await send_error(reply, error, rid, headers)
            return True
        if stream:
            event = error_event(error)
            await reply({"type": "http.response.body", "body": event, "more_body": True})
        await reply({"type": "http.response.body", "body": b"", "more_body": False})
    except OSError:  # the caller is gone as well: nobody is left to tell
        return False
    return True


def _where(exc: BaseException) -> str:
    """The innermost frame of the gateway's own code that the exception went through."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if f.filename.startswith(_PACKAGES)] or frames
    if not ours:
        return "?"
    frame = ours[-1]
    return f"{frame.filename.removeprefix(_ROOT)}:{frame.lineno} ({frame.name})"


_ROOT = str(Path(__file__).resolve().parents[2]) + os.sep  # where gateway/ is
_PACKAGES = tuple(_ROOT + package + os.sep for package in ("gateway", "routing", "tiers"))
