"""Whether a request's tokens fit an endpoint's token budget: the rule of
prelude_seats.lua `fits`, pinned to it by tests/routing/choice/test_scorers.py."""

from __future__ import annotations


def fits(tokens: int, reserved: int, budget: int | None, whole: int, share: float) -> bool:
    """A request of `tokens` fits where `reserved` tokens (its own included) stay within
    its tier's `share` of the `budget` (None: the endpoint has none); alone there
    (`reserved == tokens`) within its share of the `whole` budget (a budget that adapts may
    have shrunk below it). A tier never fills more than its share, flex not even alone."""
    if budget is None or tokens == 0 or reserved <= budget * share:
        return True
    return reserved == tokens and tokens <= whole * share
