"""Hypothesis strategies for raw JSON text as hostile callers write it.

Values are drawn as text, not encoded from Python values, so that the bytes can hold what no
encoder writes: `\\uXXXX` escapes (also of astral characters as surrogate pairs, and of lone
surrogates), duplicate keys, integers past 64 bits, odd whitespace, and nesting near the
encoder's limit.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from gateway.edge.body import MAX_DEPTH

_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "/": "\\/"}


def _char(c: str, escape: bool) -> str:
    """One character as JSON string text: raw (escaped only where JSON demands) or \\u."""
    if escape:
        code = ord(c)
        if code > 0xFFFF:  # astral: a surrogate pair of escapes
            code -= 0x10000
            return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04X}"
        return f"\\u{code:04x}"
    if c in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[c]
    if ord(c) < 0x20:
        return f"\\u{ord(c):04x}"
    return c


_PIECE = st.builds(_char, st.characters(codec="utf-8"), st.booleans())  # no raw surrogate
_LONE = st.integers(0xD800, 0xDFFF).map(lambda code: f"\\u{code:04x}")
_CLEAN = st.lists(_PIECE, max_size=6)
# About one string in ten gets a lone surrogate escape somewhere, so that bodies are often
# accepted and deep ones often reach the depth check.
_DIRTY = st.sampled_from([False] * 9 + [True])


@st.composite
def _string(draw: st.DrawFn) -> str:
    pieces = draw(_CLEAN)
    if draw(_DIRTY):
        pieces.insert(draw(st.integers(0, len(pieces))), draw(_LONE))
    return '"' + "".join(pieces) + '"'


STRINGS = _string()
# Few distinct keys, so that objects often repeat one; "" and NUL among them.
KEYS = st.one_of(st.sampled_from(['""', '"a"', '"b"', '"\\u0000"', '"\\ud83d\\ude00"']), STRINGS)
SPACE = st.sampled_from(["", "", " ", "\n\t ", "\r\n"])

SCALARS = st.one_of(
    st.sampled_from(["null", "true", "false"]),
    st.integers().map(str),
    st.integers(min_value=2**63, max_value=10**40).map(str),
    st.integers(max_value=-(2**63) - 1, min_value=-(10**40)).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    STRINGS,
)


@st.composite
def _array(draw: st.DrawFn, inner: st.SearchStrategy[str]) -> str:
    items = draw(st.lists(inner, max_size=4))
    return "[" + draw(SPACE) + ",".join(items) + draw(SPACE) + "]"


@st.composite
def _object(draw: st.DrawFn, inner: st.SearchStrategy[str]) -> str:
    pairs = draw(st.lists(st.tuples(KEYS, inner), max_size=4))
    sep = draw(SPACE)
    return "{" + ",".join(f"{sep}{k}{sep}:{v}" for k, v in pairs) + "}"


VALUES = st.recursive(SCALARS, lambda inner: _array(inner) | _object(inner), max_leaves=10)


@st.composite
def deep_values(draw: st.DrawFn) -> str:
    """A value wrapped so that a body holding it at its top level nests near MAX_DEPTH."""
    levels = draw(st.integers(MAX_DEPTH - 4, MAX_DEPTH + 2))
    shape = draw(st.sampled_from(["[", "{", "mixed"]))
    text: str = draw(SCALARS)
    for level in range(levels):
        kind = shape if shape != "mixed" else "[{"[level % 2]
        text = f"[{text}]" if kind == "[" else f'{{"k":{text}}}'
    return text


@st.composite
def bodies(draw: st.DrawFn, base: dict[str, str]) -> bytes:
    """A JSON object text: random fields, then `base` (raw JSON per field) so that it wins
    over any duplicate the random fields drew."""
    fields = draw(st.lists(st.tuples(KEYS, VALUES | deep_values()), max_size=4))
    parts = [f"{k}:{v}" for k, v in fields] + [f'"{k}":{v}' for k, v in base.items()]
    return ("{" + draw(SPACE) + ",".join(parts) + "}").encode("utf-8")


def depth(value: Any) -> int:
    """Levels of nesting, the outermost container counting 1."""
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


def has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(map(has_lone_surrogate, value))
    return False
