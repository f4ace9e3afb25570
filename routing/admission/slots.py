"""One model's slots in Redis: its keys, and the script calls on them as typed values.

Keys of one model share the hash tag `{model}` (one Redis Cluster slot per script call);
times come from Redis `TIME` inside the scripts, never from a replica's clock.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from routing.admission.timing import Timing
from routing.choice.affinity import Ring
from routing.store.keys import account_tag, model_key, model_keys
from routing.store.scripts import Call
from tiers.policy import BY_RANK, Tier

GRANTED, QUEUED, BUSY, FULL, ACCOUNT_FULL, NO_INDEX, PAST_DEADLINE = 1, 2, 0, -1, -2, -3, -4
# A waiter's place in its model's queue: rank x RANK + its sequence (as in prelude).
RANK = 10**15
# A tier's ceiling that does not bind (as in prelude).
UNBOUND = "-"


def make_lease_id(prefix: str, weight: float, account: str, tokens: int = 0) -> str:
    """An id that carries its account and weight, and the tokens it reserves of an
    endpoint's budget (none: 0), so that every script knows whose a lease or waiter is and
    what it holds from the id alone, a dead replica's too (fair share, token budgets;
    prelude `account_of`, `tokens_of`). The account is named by its digest
    (`account_tag`): any name fits, and no name shows in Redis."""
    digest = account_tag(account)
    if tokens > 0:
        return f"{prefix}~{tokens}~{weight:g}~{digest}"
    return f"{prefix}~{weight:g}~{digest}"


# How each tier shares a model's slots among waiting accounts (`tiers.<tier>.fairness`), as
# the scripts spell it (prelude `parse_spec`).
FAIRNESS_LETTER = {"accounts": "a", "tokens": "t", "fifo": "f"}
# An endpoint in rotation as admission knows it: (url, max_concurrency, load penalty), and
# its token budget (tokens of KV cache its requests may reserve; None: none) where it has one,
# and its whole budget (what it holds unadapted: the most a request alone there may reserve;
# absent: the budget itself).
EndpointSpec = (
    tuple[str, int, float]
    | tuple[str, int, float, int | None]
    | tuple[str, int, float, int | None, int | None]
)
# Endpoints a sweep checks the place in `free` of, in turn (`ModelSlots._recheck`).
RECHECK = 8
# How many endpoints prefix-cache affinity prefers for a key (small and fixed: an acquire
# tries these, then the least loaded).
PREFERRED = 4


class ModelSlots:
    """One model's keys and the script calls on them.

    The endpoints in rotation (healthy ones) and so the capacity and tier ceilings change
    with health. The endpoints live in Redis (the endpoint index, routing/store/lua/
    index.lua), written when they change (`index`), never passed per call: what a call
    costs does not grow with the number of endpoints.
    """

    def __init__(
        self,
        model: str,
        utilization: dict[Tier, float],
        max_queue: int,
        timing: Timing,
        fair: dict[Tier, bool] | dict[Tier, str] | None = None,
        *,
        preempt: Collection[Tier] = (),
        declare_all: bool = True,
    ) -> None:
        """`declare_all`: pass the scripts every key of the model, not only the leases
        (a Redis Cluster: a node that is handing the slot on checks the keys a script was
        given before it runs; a key it only names could fail it midway)."""
        self.model, self.keys = model, model_keys(model)
        # What the scripts are given: the leases first; on one Redis only those, as the
        # scripts name the others after it, a key passed costing a script more than a name
        # it makes (routing/store/lua/prelude_*.lua).
        self._key = self.keys if declare_all else self.keys[:1]
        # Where grants are announced; the tokens each endpoint's leases reserve (prelude
        # `ep_tok`), read for metrics; the leases offered to preemption (`pre`) and the
        # preempted ones not given back yet (`doomed`).
        self.channel, self.reserved_key = model_key(model, "wake"), model_key(model, "ep_tok")
        self.pre_key, self.doomed_key = model_key(model, "pre"), model_key(model, "doomed")
        self._timing = timing
        # Whether this replica has seen the model's state in Redis (a sweep answered: if it
        # is gone later, Redis lost it, prelude `lost`); the waiters per tier the last
        # sweep found (which partition a request queues in).
        self.known, self.seen_queue = False, dict[Tier, int]()
        # The model's endpoints as configured (None: not told; see `_ceiling`); url ->
        # (max_concurrency, penalty, token budget or 0, whole budget or 0) of those in rotation.
        self.configured: frozenset[str] | None = None
        self._spec: dict[str, tuple[int, float, int, int]] = {}
        # The index as this replica last wrote it (None: to be written whole), and its
        # version: a change applies only over that (routing/store/lua/index.lua).
        self._written: dict[str, tuple[int, float, int, int]] | None = None
        self._written_version, self.version, self.ring, self._rechecked = "", "", Ring(()), 0
        self.urls: list[str] = []
        self.configure(utilization, max_queue, fair, preempt=preempt)

    def configure(
        self,
        utilization: dict[Tier, float],
        max_queue: int,
        fair: dict[Tier, bool] | dict[Tier, str] | None = None,
        configured: Iterable[str] | None = None,
        preempt: Collection[Tier] = (),
    ) -> None:
        """Tier ceilings, queue bound, how each tier shares between accounts (`fair`: its
        fairness, accounts | tokens | fifo, or True for accounts and False for fifo;
        default: accounts), the model's endpoints as configured (see `_ceiling`) and the
        tiers that may preempt flex (`preempt`), set again by a config reload."""
        self.max_queue = max_queue
        # Each tier's part in preemption, as the scripts spell it (prelude `roles`):
        # 'p' may preempt, 'v' flex when some tier may preempt it, '-' neither.
        self._roles = "".join(
            "p" if t in preempt else "v" if t.preemptible and preempt else "-" for t in BY_RANK
        )
        if configured is not None:
            self.configured = frozenset(configured)
        self._utilization = [utilization[t] for t in BY_RANK]
        # Each tier's share of an endpoint's token budget: its max_utilization.
        self._shares = [f"{u:g}" for u in self._utilization]
        self._fair = "".join(_letter(None if fair is None else fair[t]) for t in BY_RANK)
        self.set_endpoints([(u, *self._spec[u]) for u in self.urls])

    def set_endpoints(self, endpoints: Sequence[EndpointSpec]) -> None:
        """The endpoints in rotation (`EndpointSpec`). Redis learns them from the next
        `index` call."""
        specs = [_spec_of(e) for e in endpoints]
        self.capacity = sum(size for _, (size, *_) in specs)
        urls = [url for url, _ in specs]
        self.ring = self.ring.changed(urls)
        self.urls = urls
        self._spec = dict(specs)
        # Whether any endpoint holds a token budget: requests then carry a reservation.
        self.budgeted = any(budget for _, (_, _, budget, _) in specs)
        # A tier's ceiling at the endpoints' sum is theirs: `seat` holds each endpoint to its
        # size, so the scripts leave it unchecked (one call less per acquire).
        self._ceilings = [len(BY_RANK), *(self._ceiling(u) for u in self._utilization)]
        # What every pumping script needs to hand slots on, in one argument the scripts read
        # only when someone waits (prelude `parse_spec`): claim time, ceilings, which
        # tiers share between accounts.
        self._pump_spec = " ".join(
            map(
                str,
                [self._timing.claim_ms, *self._ceilings, self._fair, *self._shares, self._roles],
            )
        )
        # The index's version: its endpoints and sizes (penalties change too often to count).
        sizes = "\n".join(sorted(f"{url} {size}" for url, (size, *_) in self._spec.items()))
        self.version = hashlib.blake2b(sizes.encode(), digest_size=8).hexdigest()

    @property
    def timing(self) -> Timing:
        return self._timing

    def largest_budget(self, tier: Tier | None = None) -> int | None:
        """The most a request of `tier` may reserve on an endpoint in rotation: its share
        (max_utilization) of the largest whole token budget (None: the whole of it); a
        request reserving more could never be served at that tier (prelude `fits`, from
        the same share as the scripts read it). None when an endpoint holds no budget
        (anything fits it); 0 when none is in rotation."""
        if any(budget == 0 for _, _, budget, _ in self._spec.values()):
            return None
        whole = max((whole for *_, whole in self._spec.values()), default=0)
        if tier is None:
            return whole
        return math.floor(whole * float(self._shares[tier.rank]))

    def index(self) -> Call | None:
        """The endpoint index's change since this replica last wrote it (all of it when it
        must be written whole: `rewrite`); None when there is none. Its reply: 1 written, 0
        refused (Redis holds another version: `indexed`)."""
        written, spec = self._written, self._spec
        whole = written is None
        if written is None:
            changed, leaving = list(spec), []
        else:
            changed = [url for url, now in spec.items() if written.get(url) != now]
            leaving = [url for url in written if url not in spec]
            if not changed and not leaving:
                return None
        base = "" if whole else self._written_version
        self._written, self._written_version = dict(spec), self.version
        t = self._timing
        args: list[Any] = [self.version, base, int(self.known), t.rebuild_ms, len(changed)]
        for url in changed:
            args += (url, *spec[url])
        args += (len(leaving), *leaving)
        return ("index", self._key, args)

    def indexed(self, reply: Any) -> None:
        """An index write's reply (or its error): one that failed or was refused, or may
        have, is written whole next time."""
        if isinstance(reply, BaseException) or reply != 1:
            self.rewrite()

    def rewrite(self) -> None:
        """Write the index whole with the next `index` call: Redis has none or another
        version, or the last write may not have reached it."""
        self._written = None

    def saw(self, version: str) -> None:
        """The index version a sweep found in Redis: another than this replica's view is
        written over whole."""
        if version != self.version:
            self.rewrite()

    def _ceiling(self, utilization: float) -> float | str:
        """A tier's ceiling; `UNBOUND` when it is the endpoints' sum and every endpoint of
        the model is in rotation. Then no lease can run where `seat` does not hold each
        endpoint to its size. While an endpoint is out, its leases still count: the
        requests moved off it (`move`) need the room."""
        ceiling = self.capacity * utilization
        whole = self.configured is not None and self.configured <= self._spec.keys()
        return UNBOUND if whole and ceiling >= self.capacity else ceiling

    def acquire(
        self,
        lease_id: str,
        tier: Tier,
        *,
        may_wait: bool,
        affinity: Sequence[str] | None = None,
        account: tuple[str, int] | None = None,
        max_turn: int | None = None,
        at_head: bool = False,
    ) -> Call:
        """`affinity`: take the first of these endpoints with room (prefix-cache order, a
        few: `PREFERRED`); else the least loaded. `account` (its key and limit, on one Redis
        only: the call then touches two hash tags): take the account's own slot first, or
        nothing (`ACCOUNT_FULL`). `max_turn`: the most grants it may wait behind to meet
        its deadline (None: no deadline; more: `PAST_DEADLINE`, not queued). `at_head`:
        queued before its tier's waiters (a preempted request's second try)."""
        preferred = [u for u in affinity if u in self._spec] if affinity else []
        t = self._timing
        role = self._roles[tier.rank]
        packed = (
            f"{int(may_wait)} {self.max_queue} {t.waiter_ttl_ms} {int(self.known)} {t.rebuild_ms} "
            f"{'-' if max_turn is None else max_turn} {int(at_head)} {int(role == 'p')} "
            + self._pump_spec
        )
        args = [lease_id, t.lease_ttl_ms, tier.rank, self._ceilings[1 + tier.rank],
                self._shares[tier.rank], "v" if role == "v" else "-", len(preferred),
                *preferred, packed]  # fmt: skip
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

    def cancel(self, waiter_id: str) -> Call:
        """A waiter leaves. Reply: an integer if it was still queued (now removed): the
        grants likely before it if it queued again; else its granted endpoint ('' for an id
        Redis does not know)."""
        return ("cancel", self._key, [waiter_id, self._timing.lease_ttl_ms, self._fair])

    def preemptible(self, tier: Tier) -> bool:
        """Whether a lease of `tier` may be preempted until its request starts (`start`)."""
        return self._roles[tier.rank] == "v"

    def start(self, lease_id: str, endpoint: str) -> Call:
        """A preemptible lease's request is about to send its first byte: from then on it
        is never preempted. Reply 1: go on; 0: it was preempted first."""
        return ("start", self._key, [lease_id, endpoint])

    def sweep(
        self,
        leases: Sequence[tuple[str, str]],
        waiters: Sequence[tuple[str, int]],
        pending: Sequence[str] = (),
        replica: str = "",
        alive: int | None = None,
        purge: tuple[int, Sequence[str]] | None = None,
    ) -> Call:
        """This replica's sweep of the model: `leases` it holds (id, endpoint), `waiters`
        it has queued (id, place) when it names them (not at every sweep: `Sweep.name`),
        and `pending` ids that may hold a lease it does not hold yet (counted as its own if
        they do: `Sweep.mine`). `replica`: its id, kept alive in the model (its waiters stay
        queued while it is: prelude `bury`); '' for none (every waiter named).
        `alive`: the score its last sweep answered wrote there (`Sweep.alive`), if known:
        any other found says Redis lost writes since, and its waiters are named at once.
        `purge` (with every waiter named, after Redis lost writes): the number this
        replica's ids have reached and the ids of its walks under way; whatever else of its
        ids up to that number Redis holds goes (prelude `purge`)."""
        t = self._timing
        last = "" if alive is None else alive
        args: list[Any] = [t.lease_ttl_ms, last, self._pump_spec, len(leases)]
        for pair in leases:
            args += pair
        args.append(len(waiters))
        for waiter_id, place in waiters:
            args += (waiter_id, place)
        args += (t.rebuild_ms, int(self.known))
        recheck = self._recheck()
        args += (len(recheck), *recheck)
        args += (len(pending), *pending)
        if replica:
            args += (replica, t.waiter_ttl_ms)
            if purge is not None:
                args += (purge[0], len(purge[1]), *purge[1])
        return ("sweep", self._key, args)

    def _recheck(self) -> list[str]:
        """The next few endpoints (RECHECK, in turn) whose place in `free` a sweep sets
        again from their own count: whatever it missed (a rolling update's older replicas)
        is mended within len(urls) / RECHECK sweeps, at a constant cost per sweep."""
        urls = self.urls
        if not urls:
            return []
        start = self._rechecked % len(urls)
        self._rechecked = start + RECHECK
        return [urls[(start + i) % len(urls)] for i in range(min(RECHECK, len(urls)))]

    def move(
        self, lease_id: str, avoid: str, only: Sequence[str] | None = None, *, tier: Tier
    ) -> Call:
        """Move a held lease of `tier` off `avoid` onto another endpoint with room for it
        (at most its tier's share of a token budget, as `acquire`): the least loaded of
        `only` (when given: those this replica knows), else of all."""
        urls = [u for u in only if u != avoid and u in self._spec] if only is not None else []
        if only is not None and not urls:
            urls = [""]  # none to choose from: a name no endpoint has
        share = self._shares[tier.rank]
        args = [lease_id, self._timing.lease_ttl_ms, avoid, share, len(urls), *urls, self._fair]
        return ("move", self._key, args)


def _letter(fairness: bool | str | None) -> str:
    if fairness is None or fairness is True:
        return "a"
    if fairness is False:
        return "f"
    return FAIRNESS_LETTER[fairness]


def _spec_of(endpoint: EndpointSpec) -> tuple[str, tuple[int, float, int, int]]:
    """An endpoint's entry in the index as this replica writes it: its size, its penalty
    (to 4 places: finer changes are not worth a write), its token budget (0: none) and its
    whole budget (never below the budget; 0: none)."""
    budget = int(endpoint[3] or 0) if len(endpoint) > 3 else 0
    whole = int(endpoint[4] or 0) if len(endpoint) > 4 else budget
    penalty = round(endpoint[2], 4)
    return endpoint[0], (endpoint[1], penalty, budget, max(whole, budget) if budget else 0)
