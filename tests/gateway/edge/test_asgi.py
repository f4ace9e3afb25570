"""ASGI helpers: request ids, headers, reading bodies, error replies."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import orjson
import pytest
from pydantic import BaseModel, ConfigDict

from gateway.edge.asgi import (
    MAX_REQUEST_ID,
    ClientGone,
    Message,
    error_parts,
    read_body,
    read_headers,
    request_id,
    send_error,
)
from gateway.errors import (
    AuthenticationFailed,
    ContextTooLarge,
    GatewayError,
    HeaderInvalid,
    ModelNotFound,
    PayloadTooLarge,
    RateLimited,
    RequestInvalid,
    ServiceUnavailable,
    UpstreamFailed,
)
from routing.errors import LimitReason, UnavailableReason

HEX32 = re.compile(r"^[0-9a-f]{32}$")


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = 1


class FakeReceive:
    """An ASGI `receive` that hands out the given messages and counts calls."""

    def __init__(self, messages: Iterable[Message]) -> None:
        self.messages = list(messages)
        self.calls = 0

    async def __call__(self) -> Message:
        self.calls += 1
        return self.messages.pop(0)


def body_messages(*chunks: bytes) -> list[Message]:
    return [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]


def header_dict(headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    found = dict(headers)
    assert len(found) == len(headers), "no header twice"
    return found


# --- request_id --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rid", ["abc", "req-123_ABC.x:y/z", "a b", "x" * MAX_REQUEST_ID, "0" * 32, "~!@#$%^&*()"]
)
def test_valid_request_id_is_kept(rid: str) -> None:
    assert request_id(rid) == rid


@pytest.mark.parametrize(
    "rid",
    [
        None,
        "",
        "x" * (MAX_REQUEST_ID + 1),
        "caf\u00e9",
        "id\u2028x",
        "a\r\nSet-Cookie: x=1",
        "a\nb",
        "a\x00b",
        "a\tb",
        "a\x7fb",
    ],
)
def test_bad_request_id_is_replaced(rid: str | None) -> None:
    new = request_id(rid)
    assert HEX32.match(new)
    assert new != rid


def test_new_request_ids_are_unique() -> None:
    assert len({request_id(None) for _ in range(50)}) == 50


def test_read_headers_picks_the_wanted_ones() -> None:
    scope = {
        "headers": [
            (b"authorization", b"Bearer k"),
            (b"x-request-id", b"r1"),
            (b"x-deepinfra-service-tier", b"flex"),
            (b"x-deepinfra-source", b"web"),
            (b"content-length", b"12"),
            (b"x-other", b"ignored"),
        ]
    }
    found = read_headers(scope)
    assert found.authorization == "Bearer k"
    assert found.request_id == "r1"
    assert found.service_tier == "flex"
    assert found.source == "web"
    assert found.content_length == "12"
    assert found.x_api_key is None


def test_a_repeated_request_timeout_is_kept_whole() -> None:
    # Two deadlines are no deadline the caller meant: joined, they are refused (a 400),
    # never the last one taken silently.
    scope = {"headers": [(b"x-request-timeout", b"abc"), (b"x-request-timeout", b"5")]}
    assert read_headers(scope).request_timeout == "abc,5"


# --- read_body -----------------------------------------------------------------------------


async def test_read_body_joins_chunks() -> None:
    receive = FakeReceive(body_messages(b'{"a"', b"", b": 1", b"}"))
    assert await read_body(receive, None, 1024) == b'{"a": 1}'
    assert receive.calls == 4


async def test_read_body_single_chunk() -> None:
    receive = FakeReceive(body_messages(b"{}"))
    assert await read_body(receive, "2", 1024) == b"{}"


async def test_read_body_empty() -> None:
    receive = FakeReceive([{"type": "http.request"}])
    assert await read_body(receive, None, 1024) == b""


async def test_read_body_exactly_at_limit() -> None:
    receive = FakeReceive(body_messages(b"x" * 600, b"y" * 424))
    assert len(await read_body(receive, "1024", 1024)) == 1024


async def test_declared_length_over_limit_rejected_before_reading() -> None:
    receive = FakeReceive([])
    with pytest.raises(PayloadTooLarge) as info:
        await read_body(receive, "1025", 1024)
    assert info.value.status == 413
    assert receive.calls == 0


async def test_streamed_size_over_limit_rejected() -> None:
    receive = FakeReceive(body_messages(b"x" * 600, b"y" * 600, b"z" * 600))
    with pytest.raises(PayloadTooLarge):
        await read_body(receive, None, 1024)
    assert receive.calls == 2


async def test_lying_content_length_does_not_help() -> None:
    receive = FakeReceive(body_messages(b"x" * 2000))
    with pytest.raises(PayloadTooLarge):
        await read_body(receive, "10", 1024)


async def test_garbage_content_length_falls_back_to_streamed_size() -> None:
    receive = FakeReceive(body_messages(b"{}"))
    assert await read_body(receive, "abc", 1024) == b"{}"


async def test_disconnect_while_reading_is_client_gone() -> None:
    receive = FakeReceive([*body_messages(b"x", b"y")[:1], {"type": "http.disconnect"}])
    with pytest.raises(ClientGone):
        await read_body(receive, None, 1024)


# --- error_parts --------------------------------------------------------------------------


def test_422_renders_detail_and_the_openai_envelope() -> None:
    detail = [{"loc": ["body", "model"], "msg": "Field required", "type": "missing"}]
    status, body, headers = error_parts(RequestInvalid(detail), "rid-1")
    assert status == 422
    assert orjson.loads(body) == {
        "detail": detail,
        "error": {
            "message": "model: Field required",
            "type": "invalid_request_error",
            "param": "model",
            "code": "invalid_request",
        },
    }
    found = header_dict(headers)
    assert found[b"x-request-id"] == b"rid-1"
    assert found[b"x-should-retry"] == b"false"


def test_422_envelope_names_a_nested_field() -> None:
    detail = [{"loc": ["body", "messages", 0, "role"], "msg": "bad role", "type": "x"}]
    error = orjson.loads(error_parts(RequestInvalid(detail), "r")[1])["error"]
    assert (error["param"], error["message"]) == ("messages.0.role", "messages.0.role: bad role")


@pytest.mark.parametrize(
    "error",
    [
        {"loc": ["body", 7], "msg": "JSON decode error: x", "type": "json_invalid"},
        {"loc": ["body"], "msg": "Input should be a JSON object", "type": "model_attributes_type"},
    ],
)
def test_422_envelope_for_the_body_as_a_whole(error: dict[str, Any]) -> None:
    rendered = orjson.loads(error_parts(RequestInvalid([error]), "r")[1])
    assert rendered["detail"] == [error]
    assert rendered["error"]["param"] is None
    assert rendered["error"]["message"] == f"body: {error['msg']}"


def test_401_adds_www_authenticate_and_no_retry() -> None:
    status, body, headers = error_parts(AuthenticationFailed(), "rid-2")
    assert status == 401
    assert orjson.loads(body)["error"]["code"] == "invalid_api_key"
    assert orjson.loads(body)["error"]["type"] == "authentication_error"
    found = header_dict(headers)
    assert found[b"www-authenticate"] == b"Bearer"
    assert found[b"x-should-retry"] == b"false"
    assert found[b"x-request-id"] == b"rid-2"


def test_429_keeps_retry_after_and_allows_retry() -> None:
    exc = RateLimited("busy", code=LimitReason.MODEL_BUSY, retry_after_s=7)
    status, body, headers = error_parts(exc, "rid-3")
    assert status == 429
    assert orjson.loads(body) == {
        "error": {
            "message": "busy",
            "type": "rate_limit_error",
            "param": None,
            "code": "model_busy",
        }
    }
    found = header_dict(headers)
    assert found[b"retry-after"] == b"7"
    assert b"x-should-retry" not in found


@pytest.mark.parametrize(
    "exc",
    [
        ModelNotFound("no such model"),
        PayloadTooLarge("too big"),
        UpstreamFailed("broken"),
        ServiceUnavailable("down", reason=UnavailableReason.NO_HEALTHY_ENDPOINT),
        RateLimited("busy", code=LimitReason.QUEUE_FULL, retry_after_s=0),
    ],
)
def test_request_id_always_present(exc: GatewayError) -> None:
    status, body, headers = error_parts(exc, "abc")
    assert status == exc.status
    assert header_dict(headers)[b"x-request-id"] == b"abc"
    assert set(orjson.loads(body)["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("exc", "no_retry"), [(ModelNotFound("x"), True), (UpstreamFailed("x"), False)]
)
def test_should_retry_only_on_hopeless_4xx(exc: GatewayError, no_retry: bool) -> None:
    _, _, headers = error_parts(exc, "r")
    assert (b"x-should-retry" in header_dict(headers)) is no_retry


@pytest.mark.parametrize(
    "exc",
    [
        HeaderInvalid("x-request-timeout: bad", headers={"x-should-retry": "false"}),
        ContextTooLarge("too large", param="max_tokens", headers={"x-should-retry": "false"}),
    ],
)
def test_should_retry_said_once_when_the_error_says_it_too(exc: GatewayError) -> None:
    # Two `x-should-retry: false` read as "false, false": no longer what the SDK looks for.
    _, _, headers = error_parts(exc, "r")
    assert [v for k, v in headers if k == b"x-should-retry"] == [b"false"]


async def test_send_error_sends_json_with_length() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    await send_error(send, ModelNotFound("nope"), "rid-9")
    start, body = sent
    assert start["type"] == "http.response.start"
    assert start["status"] == 404
    headers = header_dict(start["headers"])
    assert headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(body["body"])
    assert headers[b"x-request-id"] == b"rid-9"
    assert orjson.loads(body["body"])["error"]["code"] == "model_not_found"
