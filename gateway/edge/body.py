"""The request body: parsed as JSON and validated, refused (422, naming the field) when the
gateway could not pass it on to the worker intact, and encoded again for the worker.

orjson first; the stdlib parser only where orjson would lose something (integers past 64
bits, lone surrogates, which it refuses without saying where).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from gateway.errors import RequestInvalid

ModelT = TypeVar("ModelT", bound=BaseModel)


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
        # model_validate's own validator, called without its wrapper and keyword arguments.
        request: ModelT = schema.__pydantic_validator__.validate_python(payload)
        return payload, request
    except ValidationError as exc:
        raise RequestInvalid(validation_detail(exc, payload)) from None


def _loads(body: bytes) -> Any:
    """The body's JSON value, refused (422) if the gateway could not pass it on intact."""
    # One pass in C classifies every byte (a regex over the body cost ~8x more).
    shape = body.translate(_SHAPE)
    # Nesting past MAX_DEPTH takes that many opening brackets: only bodies with many
    # containers pay for the depth check.
    may_nest = shape.count(b"[") > MAX_DEPTH
    if _LONG_RUN not in shape:
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            if "depth limit" in exc.msg:  # past orjson's own 1024 levels
                raise _unfit_error(_Unfit(_TOO_DEEP, "nesting_too_deep")) from None
            # orjson refuses lone surrogates without saying where: the stdlib parser below
            # takes them, so the check after it can name the field.
            if "surrogate" not in exc.msg:
                raise _malformed(exc.msg, exc.pos) from None
        else:
            if may_nest:
                _check_encodable(payload)
            return payload
    # orjson reads integers past 64 bits as lossy floats; the stdlib keeps them exact.
    payload = _stdlib_loads(body)
    surrogates = _SURROGATE_ESCAPE.search(body) is not None
    if surrogates or may_nest:
        _check_fit(payload, surrogates=surrogates)
    return payload


def _stdlib_loads(body: bytes) -> Any:
    try:
        # Decoded here, strictly: json.loads(bytes) would take UTF-16/32 and let encoded
        # surrogates through ('surrogatepass'), which orjson refuses.
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _malformed(f"invalid UTF-8 ({exc.reason})", exc.start) from None
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise _malformed(exc.msg, exc.pos) from None
    except RecursionError:  # some hundreds of levels, far past MAX_DEPTH
        raise _unfit_error(_Unfit(_TOO_DEEP, "nesting_too_deep")) from None
    except ValueError as exc:
        raise _malformed(str(exc), 0) from None


# Digits become "0", "[" and "{" become "[", any other byte a space. A run of 19 digits may
# be an integer past 64 bits (and if it sits in a string, the stdlib path costs a little).
_SHAPE = bytes(48 if 48 <= b <= 57 else 91 if b in b"[{" else 32 for b in range(256))
_LONG_RUN = b"0" * 19
# The only way a lone surrogate reaches a str once the bytes are strict UTF-8: an escape.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")

# orjson encodes at most this many levels of nesting (objects and arrays together; its
# parser takes 1024). The edge refuses deeper bodies, so that `dumps` never meets one;
# tests pin the figure to the installed orjson.
MAX_DEPTH = 254
# A refused body's `loc` is bounded: so many parts, each key cut to so many characters.
MAX_LOC_PARTS = 16
MAX_LOC_KEY = 64


class _Unfit(Exception):
    """Why a parsed body cannot be passed on intact, and where (filled while unwinding)."""

    def __init__(self, msg: str, kind: str) -> None:
        super().__init__(msg)
        self.msg = msg
        self.kind = kind
        self.path: list[str | int] = []  # innermost first


def _check_encodable(payload: Any) -> None:
    """What orjson parsed, only depth can keep it from re-encoding; orjson's own encoder
    tells (a pass in C, several times cheaper than a walk in Python), the walk says where."""
    try:
        orjson.dumps(payload)
    except TypeError:
        _check_fit(payload, surrogates=False)
        raise _unfit_error(_Unfit(_TOO_DEEP, "nesting_too_deep")) from None


def _check_fit(payload: Any, *, surrogates: bool) -> None:
    # Only containers are walked: any other top-level value is refused as not an object.
    if isinstance(payload, (dict, list)):
        try:
            _walk(payload, 1, surrogates)
        except _Unfit as exc:
            raise _unfit_error(exc) from None


_LONE_SURROGATE = "String should not hold a lone UTF-16 surrogate"
_TOO_DEEP = f"JSON nesting should be at most {MAX_DEPTH} levels deep"


def _walk(value: dict[str, Any] | list[Any], depth: int, surrogates: bool) -> None:
    """Raise _Unfit at the first container past MAX_DEPTH, or (if `surrogates`) the first
    key or string holding a lone surrogate. Recursion stops at MAX_DEPTH + 1 levels."""
    if depth > MAX_DEPTH:
        raise _Unfit(_TOO_DEEP, "nesting_too_deep")
    pairs: Iterable[tuple[str | int, Any]]
    if isinstance(value, dict):
        if surrogates and any(_SURROGATE.search(key) is not None for key in value):
            # Named by the object holding it: the key itself could not be rendered.
            raise _Unfit("Keys should not hold a lone UTF-16 surrogate", "string_unicode")
        pairs = value.items()
    else:
        pairs = enumerate(value)
    for where, item in pairs:
        try:
            if isinstance(item, (dict, list)):
                _walk(item, depth + 1, surrogates)
            elif surrogates and isinstance(item, str) and _SURROGATE.search(item) is not None:
                raise _Unfit(_LONE_SURROGATE, "string_unicode")
        except _Unfit as exc:
            exc.path.append(where)
            raise


def _unfit_error(exc: _Unfit) -> RequestInvalid:
    path = exc.path[::-1]
    if exc.kind == "nesting_too_deep":
        # The indices down a run of nested arrays tell nothing: name the field holding it.
        while path and isinstance(path[-1], int):
            path.pop()
    loc = [p[:MAX_LOC_KEY] if isinstance(p, str) else p for p in path[:MAX_LOC_PARTS]]
    return RequestInvalid([{"loc": ["body", *loc], "msg": exc.msg, "type": exc.kind}])


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
    """The forward body: orjson, or the stdlib for integers past 64 bits. Never fails for a
    payload `parse_body` accepted (nesting within MAX_DEPTH, no lone surrogates)."""
    try:
        return orjson.dumps(payload)
    except TypeError:
        return json.dumps(payload, separators=(",", ":")).encode("utf-8")


def validation_detail(exc: ValidationError, payload: Any) -> list[dict[str, Any]]:
    """Pydantic errors in the seeds' HTTPValidationError shape, `loc` starting with body and
    naming places in the caller's body only (`prompt.1`, not pydantic's `prompt.list.1`)."""
    return [
        {"loc": ["body", *_body_loc(err["loc"], payload)], "msg": err["msg"], "type": err["type"]}
        for err in exc.errors(include_url=False, include_context=False, include_input=False)
    ]


def _body_loc(loc: tuple[int | str, ...], payload: Any) -> list[int | str]:
    """`loc` without the tags pydantic puts in it for tagged unions (`list`, `str`, a role):
    walked along the body, a name that is no key where it stands is a tag, unless it ends
    the `loc` of an object (a missing field is no key either)."""
    found: list[int | str] = []
    at = payload
    for i, part in enumerate(loc):
        inside_dict = isinstance(at, dict) and part in at
        if inside_dict or (isinstance(at, list) and isinstance(part, int) and 0 <= part < len(at)):
            at = at[part]
        elif isinstance(part, str) and not (isinstance(at, dict) and i == len(loc) - 1):
            continue  # a union's tag, not a place in the body
        else:
            at = None
        found.append(part)
    return found
