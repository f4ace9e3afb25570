"""Admission while Redis is unreachable, under `on_outage: local` (SPEC 4).

Each replica admits against its own share of a model's capacity. The shares are cut from
the list of live replicas as last read from Redis (the sweep's heartbeat), so that across
the fleet they add up to at most the capacity: `capacity // n` each, and the remainder to
the first replicas of the sorted list. A replica's share counts every slot it still holds
of that model, including those Redis admitted before the outage. A replica that never saw
the fleet, or whose share is 0, admits nothing (503 with the reason).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tiers.policy import Tier, TiersConfig


class LocalShares:
    def __init__(self, replica_id: str, tiers: TiersConfig) -> None:
        self.replica_id = replica_id
        self.tiers = tiers
        self.capacity: dict[str, int] = {}
        # The live replicas' ids as the last heartbeat saw them (None: never seen).
        self._fleet: list[str] | None = None

    def saw(self, replicas: Sequence[str]) -> None:
        fleet = sorted(set(replicas) | {self.replica_id})
        self._fleet = fleet

    @property
    def replicas(self) -> int:
        return len(self._fleet) if self._fleet is not None else 0

    def share(self, model: str) -> int:
        """This replica's slots of `model` while Redis is away."""
        if self._fleet is None:
            return 0
        capacity, n = self.capacity.get(model, 0), len(self._fleet)
        index = self._fleet.index(self.replica_id)
        return capacity // n + (1 if index < capacity % n else 0)

    def room(self, model: str, tier: Tier, holding: int) -> bool:
        """Whether one more request of `tier` fits this replica's share, given the slots
        of the model it holds now."""
        ceiling = math.floor(self.share(model) * self.tiers.policy(tier).max_utilization + 1e-9)
        return holding < ceiling
