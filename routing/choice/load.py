"""An endpoint's load score: the rule by which `free` ranks the endpoints with room
(prelude_seats.lua `rescore`), and the outage picker ranks them too (`pick`)."""

from __future__ import annotations


def score(
    load: int, size: int, penalty: float = 0.0, reserved: int = 0, budget: int | None = None
) -> float | None:
    """`load` requests on an endpoint of `size` slots (and `reserved` tokens of its
    `budget`, where it has one): the larger of the two shares, plus the worker's own
    `penalty`; None when it has no room (a share at 1 or more). Lower goes first. (The
    script adds a tie-break below 1e-6: among equals, the one touched longest ago.)"""
    used = load / max(1, size)
    if budget:
        used = max(used, reserved / budget)
    return None if used >= 1 else used + penalty
