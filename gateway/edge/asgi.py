"""Plain-ASGI helpers for the hot routes: headers, request id, the body's bytes, JSON and
error replies (the body's parsing is gateway/edge/body.py).

The completion routes bypass Starlette's request/response objects (every layer on
the hot path costs); these helpers keep that code short and in one place.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.edge.protocol import write_answer, write_stream_start
from gateway.errors import GatewayError, PayloadTooLarge, RequestInvalid

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_REQUEST_ID = 128
# 4xx answers that no retry can fix: tell the OpenAI SDK not to retry them.
_NO_RETRY = frozenset({400, 401, 403, 404, 405, 413, 415, 422})


@dataclass(slots=True)
class RequestHeaders:
    """The few request headers the gateway reads, picked in one pass."""

    authorization: str | None = None
    x_api_key: str | None = None
    xi_api_key: str | None = None
    request_id: str | None = None
    service_tier: str | None = None
    source: str | None = None
    content_length: str | None = None
    traceparent: str | None = None
    tracestate: str | None = None
    request_timeout: str | None = None
    content_encoding: str | None = None


_WANTED = {
    b"authorization": "authorization",
    b"x-api-key": "x_api_key",
    b"xi-api-key": "xi_api_key",
    b"x-request-id": "request_id",
    b"x-deepinfra-service-tier": "service_tier",
    b"x-deepinfra-source": "source",
    b"content-length": "content_length",
    b"traceparent": "traceparent",
    b"tracestate": "tracestate",
    b"x-request-timeout": "request_timeout",
    b"content-encoding": "content_encoding",
}


def read_headers(scope: Scope) -> RequestHeaders:
    found = RequestHeaders()
    for name, value in scope["headers"]:
        attr = _WANTED.get(name)
        if attr is not None:
            text = value.decode("latin-1")
            if attr == "tracestate" and found.tracestate is not None:
                text = f"{found.tracestate},{text}"  # W3C: repeated headers are one list
            elif attr == "traceparent" and found.traceparent is not None:
                text = ""  # W3C: two traceparents are no trace context (dropped)
            elif attr == "content_encoding" and found.content_encoding is not None:
                text = f"{found.content_encoding},{text}"  # RFC 9110: one list, in order
            elif attr == "request_timeout" and found.request_timeout is not None:
                text = f"{found.request_timeout},{text}"  # two deadlines: none is meant (400)
            setattr(found, attr, text)
    return found


def request_id(supplied: str | None) -> str:
    """The caller's id when it is short printable ASCII (no CR/LF/NUL), else a new one."""
    if (
        supplied
        and len(supplied) <= MAX_REQUEST_ID
        and supplied.isascii()
        and supplied.isprintable()
    ):
        return supplied
    return os.urandom(16).hex()  # 32 hex digits, as uuid4().hex, at a quarter of its cost


async def read_body(receive: Receive, content_length: str | None, limit: int) -> bytes:
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            declared = 0
        if declared > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class Reply:
    """The caller's `send`, remembering how far the answer got: a last-resort error must
    know whether it can still be a status, only an SSE event, or nothing at all."""

    __slots__ = ("_send", "ended", "started")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.ended = False

    async def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole answer: in one write where the server allows (gateway/edge/protocol.py)."""
        if await write_answer(self._send, status, headers, body):
            self.started = self.ended = True
            return
        length = (b"content-length", str(len(body)).encode("latin-1"))
        await self({"type": "http.response.start", "status": status, "headers": [length, *headers]})
        await self({"type": "http.response.body", "body": body})

    async def start_stream(
        self, status: int, headers: list[tuple[bytes, bytes]], first: bytes
    ) -> None:
        """The head of a stream and its first part (`first`, may be empty): in one write
        where the server allows (gateway/edge/protocol.py); more parts follow through `self`."""
        if await write_stream_start(self._send, status, headers, first):
            self.started = True
            return
        await self({"type": "http.response.start", "status": status, "headers": headers})
        if first:
            await self({"type": "http.response.body", "body": first, "more_body": True})

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif not message.get("more_body", False):
            self.ended = True
        await self._send(message)


class ClientGone(Exception):
    """The caller disconnected; nothing more can be sent to it."""


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body is larger than the limit of {limit} bytes.")


def error_parts(
    exc: GatewayError, rid: str, extra: Sequence[tuple[bytes, bytes]] = ()
) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """The error's status, body and headers; `extra`: headers every answer to this caller
    carries (a rate-limited key's x-ratelimit-*)."""
    if isinstance(exc, RequestInvalid):
        # The seeds' HTTPValidationError, and beside it the envelope OpenAI clients show.
        body = orjson.dumps({"detail": exc.detail, **exc.envelope()})
    else:
        body = orjson.dumps(exc.envelope())
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
    if exc.status in _NO_RETRY and "x-should-retry" not in exc.headers:  # said once only
        headers.append((b"x-should-retry", b"false"))
    headers.append((b"x-request-id", rid.encode("latin-1")))
    headers.extend(extra)
    return exc.status, body, headers


async def send_error(
    send: Send, exc: GatewayError, rid: str, extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    status, body, headers = error_parts(exc, rid, extra)
    await send_json(send, status, body, headers)


async def send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    if isinstance(send, Reply):
        await send.answer(status, [(b"content-type", b"application/json"), *headers], body)
        return
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode("latin-1")),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
