"""The outage picker: while Redis is away (`on_outage: local`) a replica chooses an
endpoint from its own counts, by the scorers the acquire script's choice follows."""

from __future__ import annotations

from collections.abc import Sequence

from routing.choice.load import score


def least_loaded(loads: Sequence[tuple[int, int, float]], turn: int) -> int | None:
    """Of endpoints given as (in flight, size, penalty), the index of the lowest load
    score; ties by `turn` (round robin, as the script's tie-break takes turns). Where none
    has room by these counts (they are this replica's alone), the least loaded relative to
    its size; None when there is no endpoint."""
    if not loads:
        return None
    scores = [score(load, size, penalty) for load, size, penalty in loads]
    ranked = [(s, i) for i, s in enumerate(scores) if s is not None]
    if not ranked:
        ranked = [(load / max(1, size), i) for i, (load, size, _) in enumerate(loads)]
    best = min(s for s, _ in ranked)
    tied = [i for s, i in ranked if s == best]
    return tied[turn % len(tied)]
