"""The tokens reserved on each endpoint with a token budget, read for the metrics by the
keeper's sweeps (every RESERVED_EVERY rounds: one HGETALL per model with budgets,
O(its endpoints), never per request)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from routing.admission.admit import Admission
from routing.store.wire import text

RESERVED_EVERY = 5


class ReservedTokens:
    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        # Per (model, endpoint), as a recent sweep read them; an endpoint no longer
        # configured leaves once it reads 0 (`saw`).
        self.reserved: dict[tuple[str, str], int] = {}
        # The partitions whose last read found tokens reserved (read until none are).
        self._reserving: set[str] = set()

    def reads(self, models: Sequence[str]) -> list[str]:
        """The partitions whose reserved tokens a round reads: those with a budget, those
        whose last read found reservations (what an endpoint out of rotation held ends),
        and those of endpoints a reload took away (read until they leave `reserved`)."""
        layout = self._admission.layout
        gone = {layout.part_of.get(p, p[0]) for p in self.reserved if p not in layout.configured}
        return [
            m
            for m in models
            if self._admission.slots[m].budgeted or m in self._reserving or m in gone
        ]

    def saw(self, part: str, reply: Any) -> None:
        """A partition's tokens reserved per endpoint, for the endpoints this replica knows
        (a metric's label values come from its config, never from Redis): those in rotation
        and those told before (out of rotation, or gone with a reload, their leases end);
        one gone from the config leaves once nothing is reserved there."""
        adm = self._admission
        model = adm.model_of.get(part, part)
        known = set(adm.slots[part].urls)
        known.update(
            url
            for m, url in self.reserved
            if m == model and adm.layout.part_of.get((m, url), part) == part
        )
        found = (
            dict(zip(reply[::2], reply[1::2], strict=True)) if isinstance(reply, list) else reply
        )
        values = {text(url): int(tokens) for url, tokens in found.items()}
        for url in known:
            tokens = values.get(url, 0)
            if tokens or (model, url) in adm.layout.configured:
                self.reserved[model, url] = tokens
            else:  # gone from the config, nothing reserved there: no longer shown
                self.reserved.pop((model, url), None)
        if any(values.get(url, 0) for url in known):
            self._reserving.add(part)
        else:
            self._reserving.discard(part)
