"""A rate-limited key's headers (gateway/ratelimits.py): OpenAI's names and duration text."""

from __future__ import annotations

import pytest

from gateway.ratelimits import duration, quota_headers
from routing.quotas import Quota, Quotas


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0s"),
        (-5, "0s"),
        (1, "1ms"),
        (120, "120ms"),
        (999, "999ms"),
        (1000, "1s"),
        (1500, "1.5s"),
        (2001, "2.001s"),
        (59_999, "59.999s"),
        (60_000, "1m0s"),
        (360_000, "6m0s"),
        (61_250, "1m1.25s"),
        (3_723_000, "1h2m3s"),
    ],
)
def test_durations_are_written_as_openai_writes_them(ms: int, text: str) -> None:
    assert duration(ms) == text


def test_each_limited_kind_has_its_three_headers() -> None:
    headers = quota_headers(Quotas(Quota(30, 29, 2000), Quota(1000, 0, 60_000)))
    assert dict(headers) == {
        b"x-ratelimit-limit-requests": b"30",
        b"x-ratelimit-remaining-requests": b"29",
        b"x-ratelimit-reset-requests": b"2s",
        b"x-ratelimit-limit-tokens": b"1000",
        b"x-ratelimit-remaining-tokens": b"0",
        b"x-ratelimit-reset-tokens": b"1m0s",
    }
    assert len(headers) == 6


def test_a_kind_without_a_limit_has_none_and_an_unknown_state_only_its_limit() -> None:
    assert quota_headers(None) == ()
    assert quota_headers(Quotas()) == ()
    assert quota_headers(Quotas(tokens=Quota(500))) == ((b"x-ratelimit-limit-tokens", b"500"),)
