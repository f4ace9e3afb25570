"""The admission scripts' replies as typed values: an acquire's (`attempt`) and a sweep's
(`sweep_result`); statuses are routing/admission/slots.py's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from routing.admission.slots import GRANTED
from routing.store.wire import text
from tiers.policy import BY_RANK, Tier


# Not frozen, treated as immutable: a frozen dataclass's __init__ costs 3.5 times as much
# (0.52 against 0.15 us), and one is made per request (hot path); hashable all the same.
@dataclass(slots=True, unsafe_hash=True)
class Attempt:
    status: int
    endpoint: str
    # For BUSY/QUEUED/FULL: the model's leases (a grant's reply leaves it out: 0).
    inflight: int
    # Waiters of the same or a better tier (for BUSY/QUEUED/FULL).
    ahead: int
    # For QUEUED: the waiter's place in the queue (rank x RANK + sequence).
    place: int
    # For BUSY while Redis is being rebuilt: ms until the rebuild window ends (else 0).
    rebuild_ms: int = 0
    # For BUSY/QUEUED/FULL/PAST_DEADLINE: the grants likely to go before it (its own turn
    # under fair share; else `ahead`).
    turn: int = 0
    # For QUEUED: a lease of a tier that may be preempted was taken for it (its holder
    # gives it back: the wait is one of the holder's round trips).
    preempted: bool = False


@dataclass(frozen=True, slots=True)
class ModelState:
    inflight: int
    queued: dict[Tier, int]
    freed: int
    # The version of the endpoint index Redis holds ('' when none).
    version: str = ""


@dataclass(frozen=True, slots=True)
class Sweep:
    """What a replica's sweep of one model found."""

    state: ModelState
    # Leases of this replica that Redis had lost and the sweep wrote back.
    restored: list[str]
    # Per waiter sent: the endpoint it was granted meanwhile, or "".
    granted: list[str]
    # This replica's leases among `state.inflight`, read in the same instant: those it
    # sent, its waiters' grants, and the leases of the ids it may hold without knowing yet.
    mine: int = 0
    # The waiters sent that it found neither queued nor granted and queued again at their
    # place: a grant they had is gone (its claim time passed, Redis lost it).
    requeued: list[str] = field(default_factory=list)
    # Redis did not know this replica alive in the model: its waiters are to be named now
    # (it restarted empty, failed over, or they left the queue while the replica was away).
    name: bool = False
    # Redis's clock when the sweep ran, in ms (0: not said): how old a wake-up is.
    clock_ms: int = 0
    # Leases and waiters of this replica's ids it no longer holds, taken out (prelude
    # `purge`: a sweep after Redis lost writes).
    purged: int = 0
    # Not by its last sweep's word: Redis lost writes since (a failover to a replica that
    # lagged), and what they took back may be there again (`purged` by the next sweep).
    lost: bool = False


def attempt(reply: Any) -> Attempt:
    """The acquire script's reply: the endpoint alone when granted (a string), else a list."""
    if isinstance(reply, bytes | str):
        return Attempt(GRANTED, text(reply), 0, 0, 0)
    ahead = int(reply[3])
    turn = int(reply[6]) if len(reply) > 6 else ahead
    place = int(reply[4])  # negated when a lease was preempted for it
    return Attempt(
        int(reply[0]), text(reply[1]), int(reply[2]), ahead, abs(place), int(reply[5]), turn,
        place < 0,
    )  # fmt: skip


def sweep_result(reply: Sequence[Any]) -> Sweep:
    state = reply[0]
    queued = {tier: int(state[1 + i]) for i, tier in enumerate(BY_RANK)}
    version = text(state[2 + len(BY_RANK)]) if len(state) > 2 + len(BY_RANK) else ""
    return Sweep(
        ModelState(int(state[0]), queued, int(state[1 + len(BY_RANK)]), version),
        [text(x) for x in reply[1]],
        [text(x) for x in reply[2]],
        int(reply[3]),
        [text(x) for x in reply[4]],
        name=len(reply) > 5 and int(reply[5][0]) > 0,
        clock_ms=int(reply[5][1]) if len(reply) > 5 else 0,
        purged=int(reply[6]) if len(reply) > 6 else 0,
        lost=len(reply) > 5 and int(reply[5][0]) == 2,
    )
