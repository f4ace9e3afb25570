"""Admission while Redis is unreachable, under `on_outage: local` (docs/api.md).

Each replica admits against its own limit, so that across the fleet the limits add up to at
most the capacity. From its last sweep before the outage a replica knows how many slots of
a model the fleet held (F), how many of them were its own (h: read by the sweep's script in
the same instant as F, its acquires not answered yet included), and the live replicas. Its
limit is h plus its cut of the capacity that was free (C - F): `free // n` each, the
remainder to the first replicas of the sorted list. Summed over the fleet: F + (C - F) = C.
Requests that were running when Redis went away thus count against the limit of the
replica that holds them, and the free capacity is shared. A replica that never saw the
fleet, or whose limit is 0, admits nothing (503 with the reason).

`Outage` holds the mode (`redis.on_outage`, a pure policy that follows config reloads) and
the shares; admission hands it the walks Redis did not answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from routing.admission.holdings import Holdings, Lease
from routing.admission.plan import Candidate
from routing.errors import Limited, LimitReason, RoutingError, Unavailable, UnavailableReason
from tiers.policy import Tier, TiersConfig


class Outage:
    """What admission answers while Redis is unreachable: 503 (`reject`) or this replica's
    share (`local`)."""

    def __init__(self, mode: str, local: LocalShares) -> None:
        self.mode = mode
        self.local = local

    def admit(
        self,
        candidates: Sequence[Candidate],
        lease_id: str,
        akey: str,
        holdings: Holdings,
        exc: BaseException,
        tokens: int = 0,
    ) -> tuple[Candidate, Lease]:
        """Redis did not answer the walk (`exc`): 503, or the local share's lease (reserving
        `tokens`, as its id says)."""
        holdings.waiters.pop(lease_id, None)
        if self.mode != "local":
            raise Unavailable(
                "The admission store (Redis) is unreachable; try again shortly.",
                UnavailableReason.STORE_UNREACHABLE,
            ) from exc
        try:
            return self.local.admit(candidates, lease_id, akey, holdings, tokens)
        except RoutingError as refused:
            raise refused from exc


class LocalShares:
    def __init__(self, replica_id: str, tiers: TiersConfig) -> None:
        self.replica_id = replica_id
        self.tiers = tiers
        self.capacity: dict[str, int] = {}
        # The live replicas' ids as the last heartbeat saw them (None: never seen).
        self._fleet: list[str] | None = None
        # Per model, at the last sweep: (slots held fleet-wide, slots held by this replica).
        self._seen: dict[str, tuple[int, int]] = {}

    def saw(self, replicas: Sequence[str]) -> None:
        self._fleet = sorted(set(replicas) | {self.replica_id})

    def observe(self, model: str, fleet_inflight: int, mine: int) -> None:
        """A sweep read the model's in-flight count while this replica held `mine` slots."""
        self._seen[model] = (fleet_inflight, mine)

    @property
    def replicas(self) -> int:
        return len(self._fleet) if self._fleet is not None else 0

    def limit(self, model: str) -> int:
        """The slots of `model` this replica may hold while Redis is away."""
        if self._fleet is None:
            return 0
        fleet_inflight, mine = self._seen.get(model, (0, 0))
        free = max(0, self.capacity.get(model, 0) - fleet_inflight)
        n, index = len(self._fleet), self._fleet.index(self.replica_id)
        return mine + free // n + (1 if index < free % n else 0)

    def room(self, model: str, tier: Tier, holding: int) -> bool:
        """Whether one more request of `tier` fits this replica's limit, given the slots of
        the model it holds now."""
        ceiling = math.floor(self.limit(model) * self.tiers.policy(tier).max_utilization + 1e-9)
        return holding < ceiling

    def admit(
        self,
        candidates: Sequence[Candidate],
        lease_id: str,
        akey: str,
        holdings: Holdings,
        tokens: int = 0,
    ) -> tuple[Candidate, Lease]:
        """The first candidate this replica's share has room for, with its local lease (held
        in `holdings`; once its hop places it on an endpoint, the sweeps write it back when
        Redis answers again); else why not, about the last candidate."""
        last: RoutingError | None = None
        for cand in candidates:
            model, tier = cand.model.name, cand.tier
            if self.limit(model) == 0:
                last = Unavailable(
                    f"Redis is unreachable and this replica's share of {model!r} is 0 "
                    f"({self.replicas or 'unknown'} replicas).",
                    UnavailableReason.NO_LOCAL_SHARE,
                )
            elif self.room(model, tier, holdings.holding(model)):
                lease = Lease(lease_id, model, "", akey, 0.0, local=True, tokens=tokens)
                holdings.held[lease.id] = lease
                return cand, lease
            else:
                busy = LimitReason(tier.busy_reason)
                message = f"{model!r} has no free slot in this replica's share."
                last = Limited(message, busy, retry_after_s=1)
            last.model = model
        assert last is not None
        raise last
