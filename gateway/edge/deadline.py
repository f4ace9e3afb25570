"""The caller's deadline: `x-request-timeout`, in seconds (docs/api.md, deadlines). A wait
admission estimates longer is refused at once; a queued request leaves when it passes."""

from __future__ import annotations

import math
import re

from gateway.errors import HeaderInvalid

HEADER = "x-request-timeout"
# Past a day a deadline says nothing a tier's own queue timeout does not.
MAX_S = 86_400.0
# A decimal number as a caller writes one: ASCII digits, an optional fraction and exponent
# (float() alone also takes "1_000", "inf" and digits of other scripts).
_NUMBER = re.compile(r"\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def request_deadline(value: str | None) -> float | None:
    """The header's seconds (a decimal number > 0), None when absent; a value that is not
    one is a 400 naming the header (the caller meant something: never silently dropped)."""
    if value is None:
        return None
    text = value.strip(" \t")
    seconds = float(text) if _NUMBER.fullmatch(text) else math.nan
    if not (0.0 < seconds < math.inf):
        raise HeaderInvalid(
            f"{HEADER}: must be a number of seconds greater than 0, got {_shown(value)}.",
            param=HEADER,
            headers={"x-should-retry": "false"},
        )
    return min(seconds, MAX_S)


def _shown(value: str) -> str:
    """The value as the caller wrote it: header bytes come as latin-1, most clients send
    UTF-8 (read back as written, not as mojibake); cut to 32 characters, quoted."""
    try:
        text = value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        text = value
    return repr(text[:32])
