"""The request body: JSON parsing, the bounds that keep it forwardable, re-encoding."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import BaseModel, ConfigDict

from gateway.edge.asgi import error_parts
from gateway.edge.body import MAX_DEPTH, MAX_LOC_KEY, MAX_LOC_PARTS, dumps, parse_body
from gateway.errors import RequestInvalid
from gateway.schemas.chat import ChatRequest
from gateway.schemas.completions import CompletionRequest


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = 1


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


def assert_surrogate_refused(fragment: bytes, tail: bytes, loc: list[Any]) -> None:
    error = refused(b'{"model": "m", ' + fragment + tail + b"}")
    assert error["loc"] == loc
    assert error["type"] == "string_unicode"


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
    assert_surrogate_refused(fragment, tail, loc)


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
    assert_surrogate_refused(fragment, tail, loc)


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


@pytest.mark.parametrize(
    ("schema", "body", "loc"),
    [
        ("completion", b'{"model": "m", "prompt": [1, "x"]}', ["body", "prompt", 1]),
        ("completion", b'{"model": "m", "prompt": "x", "stop": [1]}', ["body", "stop", 0]),
        ("completion", b'{"prompt": "x"}', ["body", "model"]),
        (
            "chat",
            b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
            b'"text": 5}]}]}',
            ["body", "messages", 0, "content", 0, "text"],
        ),
        (
            "chat",
            b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}',
            ["body", "messages", 0, "content", 0, "text"],
        ),
        (
            "chat",
            b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", '
            b'"image_url": {"url": 5}}]}]}',
            ["body", "messages", 0, "content", 0, "image_url", "url"],
        ),
        (
            "chat",
            b'{"model": "m", "messages": [{"role": "user"}]}',
            ["body", "messages", 0, "content"],
        ),
    ],
)
def test_loc_names_places_in_the_body_not_union_tags(
    schema: str, body: bytes, loc: list[Any]
) -> None:
    model = ChatRequest if schema == "chat" else CompletionRequest
    with pytest.raises(RequestInvalid) as info:
        parse_body(body, model)
    assert [error["loc"] for error in info.value.detail] == [loc]
    assert info.value.envelope()["error"]["param"] == ".".join(str(p) for p in loc[1:])
