"""The caller's deadline header, `x-request-timeout` (gateway/edge/deadline.py)."""

from __future__ import annotations

import pytest

from gateway.edge.deadline import MAX_S, request_deadline
from gateway.errors import HeaderInvalid


def test_absent_is_no_deadline() -> None:
    assert request_deadline(None) is None


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("5", 5.0), ("  5 ", 5.0), ("\t2.5\t", 2.5), ("0.25", 0.25), (".5", 0.5), ("5.", 5.0),
     ("+5", 5.0), ("1e2", 100.0), ("1E-1", 0.1), ("1e9", MAX_S)],
)  # fmt: skip
def test_decimal_seconds(value: str, seconds: float) -> None:
    assert request_deadline(value) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value",
    ["", " ", "0", "-0", "-1", "0.0", "nan", "NaN", "inf", "Infinity", "1e309", "5s", "5 s",
     "1_000", "0x10", "5,6", "abc,5", "\u0661\u0662", "\u00b2", "1e-400", "e5", "."],
)  # fmt: skip
def test_anything_else_is_a_400_naming_the_header(value: str) -> None:
    with pytest.raises(HeaderInvalid) as caught:
        request_deadline(value)
    assert caught.value.status == 400
    assert caught.value.param == "x-request-timeout"
    assert caught.value.message.startswith("x-request-timeout: ")


def test_a_non_ascii_value_is_quoted_as_the_caller_wrote_it() -> None:
    """Header bytes reach the app as latin-1: a UTF-8 value is shown decoded, readable."""
    sent = "5 секунд".encode().decode("latin-1")  # what the ASGI scope holds
    with pytest.raises(HeaderInvalid) as caught:
        request_deadline(sent)
    assert "'5 секунд'" in caught.value.message
    with pytest.raises(HeaderInvalid) as caught:
        request_deadline("\xff5")  # not UTF-8: shown as it came
    assert repr("\xff5") in caught.value.message
