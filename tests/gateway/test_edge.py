"""Edge helpers: request ids, reading and parsing bodies, error replies."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import orjson
import pytest
from pydantic import BaseModel, ConfigDict

from gateway.edge import (
    MAX_DEPTH,
    MAX_LOC_KEY,
    MAX_LOC_PARTS,
    MAX_REQUEST_ID,
    ClientGone,
    Message,
    dumps,
    error_parts,
    parse_body,
    read_body,
    read_headers,
    request_id,
    send_error,
)
from gateway.errors import (
    AuthenticationFailed,
    GatewayError,
    ModelNotFound,
    PayloadTooLarge,
    RateLimited,
    RequestInvalid,
    ServiceUnavailable,
    UpstreamFailed,
)
from routing.errors import UnavailableReason

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


# --- parse_body -----------------------------------------------------------------------------


def test_parse_body_returns_raw_dict_and_model() -> None:
    raw, body = parse_body(b'{"model": "m", "n": 2, "unknown": {"x": 1}}', Body)
    assert raw == {"model": "m", "n": 2, "unknown": {"x": 1}}
    assert (body.model, body.n) == ("m", 2)


@pytest.mark.parametrize("text", [b"[]", b"[1]", b'"s"', b"1", b"null", b"true"])
def test_non_object_json_is_invalid_at_body(text: bytes) -> None:
    with pytest.raises(RequestInvalid) as info:
        parse_body(text, Body)
    assert info.value.status == 422
    assert [d["loc"] for d in info.value.detail] == [["body"]]


@pytest.mark.parametrize("text", [b"", b"{", b'{"model": }', b"{'model': 'm'}", b"\xff\xfe"])
def test_malformed_json_is_invalid_with_body_loc(text: bytes) -> None:
    with pytest.raises(RequestInvalid) as info:
        parse_body(text, Body)
    detail = info.value.detail
    assert detail
    assert detail[0]["loc"][0] == "body"
    assert detail[0]["type"] == "json_invalid"
    assert detail[0]["msg"]


def test_schema_errors_have_body_loc() -> None:
    with pytest.raises(RequestInvalid) as info:
        parse_body(b'{"n": "many"}', Body)
    locs = sorted(tuple(d["loc"]) for d in info.value.detail)
    assert locs == [("body", "model"), ("body", "n")]
    assert all(set(d) == {"loc", "msg", "type"} for d in info.value.detail)


@pytest.mark.parametrize("number", [2**64 - 1, -(2**63), 0])
def test_64_bit_integers_exact(number: int) -> None:
    raw, _ = parse_body(b'{"model": "m", "seed": %d}' % number, Body)
    assert type(raw["seed"]) is int
    assert raw["seed"] == number


@pytest.mark.parametrize("number", [2**64, -(2**63) - 1, 10**40])
def test_integers_beyond_64_bits_accepted(number: int) -> None:
    raw, _ = parse_body(b'{"model": "m", "x": %d}' % number, Body)
    assert type(raw["x"]) is int
    assert raw["x"] == number


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_constants_rejected(constant: bytes) -> None:
    with pytest.raises(RequestInvalid) as info:
        parse_body(b'{"model": "m", "temperature": %s}' % constant, Body)
    assert info.value.detail[0]["loc"][0] == "body"


def test_big_integer_fallback_still_rejects_nan_elsewhere() -> None:
    with pytest.raises(RequestInvalid):
        parse_body(b'{"model": "m", "seed": %d, "t": NaN}' % 2**70, Body)


def test_overflowing_number_rejected() -> None:
    with pytest.raises(RequestInvalid):
        parse_body(b'{"model": "m", "x": 1e400}', Body)


def test_deep_nesting_is_invalid_not_a_crash() -> None:
    text = b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(RequestInvalid):
        parse_body(text, Body)


# --- bodies the gateway could not pass on intact -------------------------------------------

BIG = b', "n": 123456789012345678901'  # a run of 19+ digits: the stdlib parser's path
# A run of digits inside a string sends the body down the stdlib path too.
DIGITS_IN_TEXT = b', "s": "call 12345678901234567890123"'
PATHS = pytest.mark.parametrize(
    "tail", [b"", BIG, DIGITS_IN_TEXT], ids=["orjson", "stdlib", "stdlib-text"]
)


def refused(body: bytes) -> dict[str, Any]:
    """The one error of a refused body, checked to render (the answer itself must encode)."""
    with pytest.raises(RequestInvalid) as info:
        parse_body(body, Body)
    status, rendered, _ = error_parts(info.value, "r")
    assert status == 422
    assert orjson.loads(rendered)["detail"] == info.value.detail
    [error] = info.value.detail
    return error


@PATHS
@pytest.mark.parametrize(
    ("fragment", "loc"),
    [
        (b'"user": "\\ud800"', ["body", "user"]),
        (b'"user": "ok \\uDFFF then"', ["body", "user"]),
        (b'"user": "\\ud83d"', ["body", "user"]),  # a high half with no low half after it
        (b'"prompt_cache_key": "\\udc00\\ud800"', ["body", "prompt_cache_key"]),  # reversed
        (b'"metadata": {"x": "\\ud800"}', ["body", "metadata", "x"]),
        (b'"metadata": {"x": [1, {"y": ["\\udbff"]}]}', ["body", "metadata", "x", 1, "y", 0]),
    ],
)
def test_lone_surrogate_in_a_value_is_422_naming_it(
    tail: bytes, fragment: bytes, loc: list[Any]
) -> None:
    error = refused(b'{"model": "m", ' + fragment + tail + b"}")
    assert error["loc"] == loc
    assert error["type"] == "string_unicode"


@PATHS
@pytest.mark.parametrize(
    ("fragment", "loc"),
    [
        (b'"\\ud800": 1', ["body"]),
        (b'"metadata": {"ok": 1, "a\\udc00": 2}', ["body", "metadata"]),
        (b'"metadata": {"list": [{"\\ud800": null}]}', ["body", "metadata", "list", 0]),
    ],
)
def test_lone_surrogate_in_a_key_is_422_naming_its_object(
    tail: bytes, fragment: bytes, loc: list[Any]
) -> None:
    error = refused(b'{"model": "m", ' + fragment + tail + b"}")
    assert error["loc"] == loc
    assert error["type"] == "string_unicode"


@PATHS
def test_surrogate_pairs_and_astral_characters_pass_whole(tail: bytes) -> None:
    body = b'{"model": "m", "user": "\\ud83d\\ude00 \xf0\x9f\x98\x80 \\u0000"' + tail + b"}"
    raw, _ = parse_body(body, Body)
    assert raw["user"] == "\U0001f600 \U0001f600 \x00"
    assert parse_body(dumps(raw), Body)[0] == raw


@PATHS
def test_encoded_surrogate_bytes_are_malformed(tail: bytes) -> None:
    # CESU-8 style bytes for U+D800: not UTF-8, on either path (json.loads(bytes) takes them).
    error = refused(b'{"model": "m", "user": "\xed\xa0\x80"' + tail + b"}")
    assert error["type"] == "json_invalid"


@PATHS
def test_utf16_body_is_malformed_on_both_paths(tail: bytes) -> None:
    text = (b'{"model": "m"' + tail + b"}").decode()
    assert refused(text.encode("utf-16"))["type"] == "json_invalid"


def test_the_encoder_limit_is_max_depth() -> None:
    """Pins MAX_DEPTH to the installed orjson: if orjson changes, this says so."""
    value: Any = 1
    for _ in range(MAX_DEPTH):
        value = [value]
    assert orjson.dumps(value)
    with pytest.raises(orjson.JSONEncodeError):
        orjson.dumps([value])


def deep_body(levels: int, tail: bytes = b"", opener: bytes = b"[") -> bytes:
    """A body nesting `levels` deep in all (the body object is level 1), under `deep`."""
    inner = levels - 1
    if opener == b"[":
        value = b"[" * inner + b"]" * inner
    else:
        value = b'{"k":' * inner + b"1" + b"}" * inner
    return b'{"model": "m", "deep": ' + value + tail + b"}"


@PATHS
@pytest.mark.parametrize("opener", [b"[", b"{"])
def test_nesting_at_the_limit_is_accepted_and_forwards(tail: bytes, opener: bytes) -> None:
    raw, _ = parse_body(deep_body(MAX_DEPTH, tail, opener), Body)
    assert parse_body(dumps(raw), Body)[0] == raw


@PATHS
def test_nesting_one_past_the_limit_is_422_naming_the_field(tail: bytes) -> None:
    error = refused(deep_body(MAX_DEPTH + 1, tail))
    assert error["loc"] == ["body", "deep"]
    assert error["type"] == "nesting_too_deep"
    assert str(MAX_DEPTH) in error["msg"]


@PATHS
def test_nested_objects_past_the_limit_name_a_bounded_path(tail: bytes) -> None:
    error = refused(deep_body(MAX_DEPTH + 1, tail, b"{"))
    assert error["loc"][:3] == ["body", "deep", "k"]
    assert len(error["loc"]) == 1 + MAX_LOC_PARTS


def test_long_keys_in_loc_are_cut() -> None:
    key = b"k" * 1000
    error = refused(b'{"model": "m", "' + key + b'": "\\ud800"}')
    assert error["loc"] == ["body", "k" * MAX_LOC_KEY]


@PATHS
@pytest.mark.parametrize("levels", [1000, 1100, 5000])
def test_far_too_deep_is_422_not_a_crash(tail: bytes, levels: int) -> None:
    # Past the parsers' own limits (orjson 1024 levels, the stdlib its recursion limit).
    assert refused(deep_body(levels, tail))["type"] == "nesting_too_deep"


def test_many_shallow_containers_are_accepted() -> None:
    tools = [{"type": "function", "function": {"parameters": {"p": {"enum": [1]}}}}] * 200
    body = orjson.dumps({"model": "m", "tools": tools})
    assert body.count(b"{") + body.count(b"[") > MAX_DEPTH
    raw, _ = parse_body(body, Body)
    assert raw["tools"] == tools


@pytest.mark.parametrize("number", [2**64, -(2**63) - 1, 10**40, -(10**100)])
def test_big_integers_are_forwarded_exactly(number: int) -> None:
    raw, _ = parse_body(b'{"model": "m", "x": [%d, {"y": %d}]}' % (number, number), Body)
    forward = dumps(raw)
    assert b"%d" % number in forward
    assert parse_body(forward, Body)[0] == raw


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
    exc = RateLimited("busy", code="model_busy", retry_after_s=7)
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
        RateLimited("busy", code="queue_full", retry_after_s=0),
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
