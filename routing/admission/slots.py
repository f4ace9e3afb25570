"""One model's slots in Redis: its keys, and the script calls on them as typed values.

Keys of one model share the hash tag `{model}` (one Redis Cluster slot per script call);
times come from Redis `TIME` inside the scripts, never from a replica's clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from routing.store.scripts import Call
from routing.store.wire import text
from tiers.policy import BY_RANK, Tier

GRANTED, QUEUED, BUSY, FULL, ACCOUNT_FULL = 1, 2, 0, -1, -2
# A waiter's place in its model's queue: rank x RANK + its sequence (as in prelude.lua).
RANK = 10**15
# A tier's ceiling that does not bind (as in prelude.lua).
UNBOUND = "-"


def make_lease_id(prefix: str, weight: float, account: str) -> str:
    """An id that carries its account and weight, so that every script knows whose a lease
    or waiter is from the id alone (fair share; prelude.lua `account_of`). The account is
    named by a short digest: any name fits, and no name shows in Redis."""
    digest = hashlib.blake2b(account.encode(), digest_size=6).hexdigest()
    return f"{prefix}~{weight:g}~{digest}"


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
    # For BUSY/QUEUED/FULL: the grants likely to go before it (its own turn under fair
    # share; else `ahead`).
    turn: int = 0


@dataclass(frozen=True, slots=True)
class ModelState:
    inflight: int
    queued: dict[Tier, int]
    freed: int


@dataclass(frozen=True, slots=True)
class Sweep:
    """What a replica's sweep of one model found."""

    state: ModelState
    # Leases of this replica that Redis had lost and the sweep wrote back.
    restored: list[str]
    # Per waiter sent: the endpoint it was granted meanwhile, or "".
    granted: list[str]


@dataclass(frozen=True, slots=True)
class Timing:
    """How long Redis keeps what a replica holds without hearing from it."""

    lease_ttl_ms: int
    # A slot granted to a waiter must be claimed by its replica within this, or goes back.
    claim_ms: int
    # A waiter stays queued this long past its replica's last sweep.
    waiter_ttl_ms: int
    # Once Redis is found to have lost a model's state, grants pause this long: every
    # replica's next sweep (and write-back) lands within it. A sweep starts at most an
    # interval after the last one ended and takes at most the command timeout (else it
    # fails as an outage): a slow Redis delays write-backs by its round trip.
    rebuild_ms: int = 1500

    @classmethod
    def of(cls, lease_ttl_s: float, sweep_interval_s: float, command_timeout_s: float) -> Timing:
        sweep_ms = int(sweep_interval_s * 1000)
        return cls(
            int(lease_ttl_s * 1000),
            max(1000, 2 * sweep_ms),
            max(3000, 3 * sweep_ms),
            sweep_ms * 3 // 2 + int(command_timeout_s * 1000),
        )


def account_key(account: str) -> str:
    return "gw:acct:{" + account + "}"


# A model's keys, each behind its hash tag (`gw:{model}:`), in the order the scripts take them.
_MODEL_KEYS = ("leases", "queue", "ep_of", "ep_load", "seq", "freed", "qexp", "rebuild")


class ModelSlots:
    """One model's keys and the script calls on them.

    The endpoints in rotation (healthy ones) and so the capacity and tier ceilings change
    with health; the script arguments are rebuilt then, not per request.
    """

    def __init__(
        self,
        model: str,
        utilization: dict[Tier, float],
        max_queue: int,
        timing: Timing,
        fair: dict[Tier, bool] | None = None,
        *,
        declare_all: bool = True,
    ) -> None:
        """`declare_all`: pass the scripts every key of the model, not only the leases
        (a Redis Cluster: a node that is handing the slot on checks the keys a script was
        given before it runs; a key it only names could fail it midway)."""
        tag = "gw:{" + model + "}:"
        self.model = model
        self.keys = [tag + k for k in _MODEL_KEYS]
        # What the scripts are given: the leases first; on one Redis only those, as the
        # scripts name the others after it, a key passed costing a script more than a name
        # it makes (routing/store/lua/prelude.lua).
        self._key = self.keys if declare_all else self.keys[:1]
        self.channel = tag + "wake"
        self._timing = timing
        # Whether this replica has seen the model's state in Redis (a sweep answered): if it
        # is gone later, Redis lost it (routing/store/lua/prelude.lua, `lost`).
        self.known = False
        # The model's endpoints as configured (None: not told); see `_ceiling`.
        self.configured: frozenset[str] | None = None
        self._spec: dict[str, tuple[int, float]] = {}
        self.urls: list[str] = []
        self.configure(utilization, max_queue, fair)

    def configure(
        self,
        utilization: dict[Tier, float],
        max_queue: int,
        fair: dict[Tier, bool] | None = None,
        configured: Iterable[str] | None = None,
    ) -> None:
        """Tier ceilings, queue bound, which tiers share between accounts (default: all) and
        the model's endpoints as configured (see `_ceiling`), set again by a config reload."""
        self.max_queue = max_queue
        if configured is not None:
            self.configured = frozenset(configured)
        self._utilization = [utilization[t] for t in BY_RANK]
        self._fair = "".join("a" if fair is None or fair[t] else "f" for t in BY_RANK)
        self.set_endpoints([(u, *self._spec[u]) for u in self.urls])

    def set_endpoints(self, endpoints: Sequence[tuple[str, int, float]]) -> None:
        """The endpoints in rotation: (url, max_concurrency, load penalty)."""
        self.capacity = sum(size for _, size, _ in endpoints)
        self.urls = [url for url, _, _ in endpoints]
        self._spec = {url: (size, penalty) for url, size, penalty in endpoints}
        # A tier's ceiling at the endpoints' sum is theirs: `pick` holds each endpoint to its
        # size, so the scripts leave it unchecked (one call less per acquire).
        self._ceilings = [len(BY_RANK), *(self._ceiling(u) for u in self._utilization)]
        self._endpoints = self._args(self.urls)
        # Ties in load go to the first endpoint listed: acquires take turns at the order.
        self._rotations = [self._args(self.urls[i:] + self.urls[:i]) for i in range(len(self.urls))]
        self._turn = 0
        # What every pumping script needs to hand slots on, in one argument the scripts read
        # only when someone waits (prelude.lua `parse_spec`): claim time, ceilings, which
        # tiers share between accounts, endpoints.
        self._pump_spec = " ".join(
            map(str, [self._timing.claim_ms, *self._ceilings, self._fair, *self._endpoints])
        )

    def _ceiling(self, utilization: float) -> float | str:
        """A tier's ceiling; `UNBOUND` when it is the endpoints' sum and every endpoint of
        the model is in rotation. Then no lease can run where `pick` does not hold each
        endpoint to its size. While an endpoint is out, its leases still count: the
        requests moved off it (`move`) need the room."""
        ceiling = self.capacity * utilization
        whole = self.configured is not None and self.configured <= self._spec.keys()
        return UNBOUND if whole and ceiling >= self.capacity else ceiling

    def _args(self, urls: Sequence[str]) -> list[Any]:
        args: list[Any] = [len(urls)]
        for url in urls:
            size, penalty = self._spec[url]
            args += [url, size, round(penalty, 4)]
        return args

    def acquire(
        self,
        lease_id: str,
        tier: Tier,
        *,
        may_wait: bool,
        affinity: Sequence[str] | None = None,
        account: tuple[str, int] | None = None,
    ) -> Call:
        """`affinity`: take the first of these endpoints with room (prefix-cache order);
        else the least loaded of all. `account` (its key and limit, on one Redis only: the
        call then touches two hash tags): take the account's own slot first, or nothing
        (`ACCOUNT_FULL`)."""
        mode, endpoints = "least", self._endpoints
        if self._rotations:
            self._turn = (self._turn + 1) % len(self._rotations)
            endpoints = self._rotations[self._turn]
        if affinity:
            mode, endpoints = "first", self._args([u for u in affinity if u in self._spec])
        t = self._timing
        packed = (
            f"{int(may_wait)} {self.max_queue} {t.waiter_ttl_ms} {int(self.known)} {t.rebuild_ms} "
            + self._pump_spec
        )
        args = [lease_id, t.lease_ttl_ms, tier.rank, self._ceilings[1 + tier.rank], mode,
                *endpoints, packed]  # fmt: skip
        if account is None:
            return ("acquire", self._key, args)
        return ("acquire", [*self._key, account[0]], [*args, account[1]])

    def release(self, ids: Sequence[str], account: str | None = None, endpoint: str = "") -> Call:
        """Give these leases back, or take these waiters out of the queue (idempotent);
        with `account` (on one Redis only), its entries for them too. `endpoint`: where
        the one lease given is (else every endpoint is looked at, which costs more)."""
        keys = self._key if account is None else [*self._key, account]
        args: list[Any] = [self._pump_spec, len(ids)]
        for lease_id in ids:
            args += (lease_id, endpoint if len(ids) == 1 else "")
        return ("release", keys, args)

    def cancel(self, waiter_id: str, rank: int = 1) -> Call:
        """A waiter of tier `rank` leaves. Reply: an integer if it was still queued (now
        removed): the grants likely before it if it queued again; else its granted endpoint
        ('' for an id Redis does not know)."""
        fair = int(self._fair[rank] == "a")
        return ("cancel", self._key, [waiter_id, self._timing.lease_ttl_ms, fair, self._pump_spec])

    def claim(self, leases: Sequence[tuple[str, str]]) -> Call:
        """Keep these (lease id, endpoint) alive, written back if Redis lost them."""
        flat = [x for pair in leases for x in pair]
        return ("claim", self._key, [self._timing.lease_ttl_ms, *flat])

    def sweep(self, leases: Sequence[tuple[str, str]], waiters: Sequence[tuple[str, int]]) -> Call:
        """This replica's sweep of the model: `leases` it holds (id, endpoint), `waiters`
        it has queued (id, place)."""
        t = self._timing
        args: list[Any] = [t.lease_ttl_ms, t.waiter_ttl_ms, self._pump_spec, len(leases)]
        for pair in leases:
            args += pair
        args.append(len(waiters))
        for waiter_id, place in waiters:
            args += (waiter_id, place)
        args += (t.rebuild_ms, int(self.known))
        return ("sweep", self._key, args)

    def move(self, lease_id: str, avoid: str, only: Sequence[str] | None = None) -> Call:
        """Move a held lease off `avoid` onto another endpoint (of `only`) with room."""
        urls = [u for u in (self.urls if only is None else only) if u != avoid and u in self._spec]
        args = [lease_id, self._timing.lease_ttl_ms, avoid, *self._args(urls)]
        return ("move", self._key, args)


def attempt(reply: Any) -> Attempt:
    """The acquire script's reply: the endpoint alone when granted (a string), else a list."""
    if isinstance(reply, bytes | str):
        return Attempt(GRANTED, text(reply), 0, 0, 0)
    ahead = int(reply[3])
    turn = int(reply[6]) if len(reply) > 6 else ahead
    return Attempt(
        int(reply[0]), text(reply[1]), int(reply[2]), ahead, int(reply[4]), int(reply[5]), turn
    )


def sweep_result(reply: Sequence[Any]) -> Sweep:
    state = reply[0]
    queued = {tier: int(state[1 + i]) for i, tier in enumerate(BY_RANK)}
    return Sweep(
        ModelState(int(state[0]), queued, int(state[1 + len(BY_RANK)])),
        [text(x) for x in reply[1]],
        [text(x) for x in reply[2]],
    )
