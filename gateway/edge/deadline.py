"""The caller's deadline: `x-request-timeout`, in seconds (docs/api.md, deadlines). A wait
admission estimates longer is refused at once; a queued request leaves when it passes."""

from __future__ import annotations

import math

from gateway.errors import HeaderInvalid

HEADER = "x-request-timeout"
# Past a day a deadline says nothing a tier's own queue timeout does not.
MAX_S = 86_400.0


def request_deadline(value: str | None) -> float | None:
    """The header's seconds (a decimal number > 0), None when absent; a value that is not
    one is a 400 naming the header (the caller meant something: never silently dropped)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        seconds = math.nan
    if not (0.0 < seconds < math.inf):
        raise HeaderInvalid(
            f"{HEADER}: must be a number of seconds greater than 0, got {value[:32]!r}.",
            param=HEADER,
            headers={"x-should-retry": "false"},
        )
    return min(seconds, MAX_S)
