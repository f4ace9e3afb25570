"""Plain-ASGI helpers for the hot routes: headers, request id, body, JSON and error replies.

The completion routes bypass Starlette's request/response objects (DESIGN: every layer on
the hot path costs); these helpers keep that code short and in one place.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from gateway.errors import GatewayError, PayloadTooLarge, RequestInvalid

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ModelT = TypeVar("ModelT", bound=BaseModel)

MAX_REQUEST_ID = 128
# 4xx answers that no retry can fix: tell the OpenAI SDK not to retry them.
_NO_RETRY = frozenset({400, 401, 403, 404, 413, 422})


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


_WANTED = {
    b"authorization": "authorization",
    b"x-api-key": "x_api_key",
    b"xi-api-key": "xi_api_key",
    b"x-request-id": "request_id",
    b"x-deepinfra-service-tier": "service_tier",
    b"x-deepinfra-source": "source",
    b"content-length": "content_length",
}


def read_headers(scope: Scope) -> RequestHeaders:
    found = RequestHeaders()
    for name, value in scope["headers"]:
        attr = _WANTED.get(name)
        if attr is not None:
            setattr(found, attr, value.decode("latin-1"))
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
    return uuid.uuid4().hex


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


class ClientGone(Exception):
    """The caller disconnected; nothing more can be sent to it."""


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body is larger than the limit of {limit} bytes.")


def parse_body(body: bytes, schema: type[ModelT]) -> tuple[dict[str, Any], ModelT]:
    """The caller's JSON object (to forward untouched) and its validated view."""
    payload = _loads(body)
    if not isinstance(payload, dict):
        raise RequestInvalid(
            [
                {
                    "loc": ["body"],
                    "msg": "Input should be a JSON object",
                    "type": "model_attributes_type",
                }
            ]
        )
    try:
        return payload, schema.model_validate(payload)
    except ValidationError as exc:
        raise RequestInvalid(validation_detail(exc)) from None


def _loads(body: bytes) -> Any:
    if _LONG_NUMBER.search(body) is None:
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise _malformed(exc.msg, exc.pos) from None
    # orjson reads integers past 64 bits as lossy floats; the stdlib keeps them exact.
    try:
        return json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise _malformed(exc.msg, exc.pos) from None
    except (ValueError, RecursionError) as exc:
        raise _malformed(str(exc), 0) from None


_LONG_NUMBER = re.compile(rb"[0-9]{19,}")


def _malformed(msg: str, pos: int) -> RequestInvalid:
    return RequestInvalid(
        [{"loc": ["body", pos], "msg": f"JSON decode error: {msg}", "type": "json_invalid"}]
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def dumps(payload: Any) -> bytes:
    """orjson, or the stdlib for what orjson cannot encode (integers past 64 bits)."""
    try:
        return orjson.dumps(payload)
    except TypeError:
        return json.dumps(payload, separators=(",", ":")).encode("utf-8")


def validation_detail(exc: ValidationError) -> list[dict[str, Any]]:
    """Pydantic errors in the seeds' HTTPValidationError shape, `loc` starting with body."""
    return [
        {"loc": ["body", *err["loc"]], "msg": err["msg"], "type": err["type"]}
        for err in exc.errors(include_url=False, include_context=False, include_input=False)
    ]


def error_parts(exc: GatewayError, rid: str) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    if isinstance(exc, RequestInvalid):
        body = orjson.dumps({"detail": exc.detail})
    else:
        body = orjson.dumps(exc.envelope())
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
    if exc.status in _NO_RETRY:
        headers.append((b"x-should-retry", b"false"))
    headers.append((b"x-request-id", rid.encode("latin-1")))
    return exc.status, body, headers


async def send_error(send: Send, exc: GatewayError, rid: str) -> None:
    status, body, headers = error_parts(exc, rid)
    await send_json(send, status, body, headers)


async def send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
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
