"""What one replica holds in Redis: the source of truth when Redis forgets (docs/architecture.md).

Redis is state that can vanish (a restart without persistence, a failover to a replica
that lost recent writes). Each replica therefore remembers, in memory, everything it holds
there: the leases of its requests in flight, the waiters it has queued, the account entries
of both, and the ids whose state in Redis is in doubt (a call that failed without an
answer, a clean-up that could not be sent). Every sweep sends all of it back: leases and
entries are kept alive or written back, waiters kept queued at their original place, and
in-doubt ids forgotten. The keeper builds those calls from here.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

# An in-doubt id is forgotten by this many successful sweeps after it was recorded: a call
# stuck in a stalled Redis may still run when Redis resumes, after the first forget.
FORGET_ROUNDS = 2
# In-doubt ids are a shortcut, not a guarantee: whatever they stand for in Redis also
# expires by itself (leases by their TTL, waiters by theirs). So the list is bounded: during
# a long outage every request may add one.
MAX_ORPHANS = 10_000


@dataclass(slots=True)
class Lease:
    """A slot held on one endpoint of one model (and in the account's own count)."""

    id: str
    model: str
    endpoint: str
    account: str  # the account's key in Redis (routing/admission/slots.py `account_key`)
    queued_ms: float
    local: bool = False
    # When the slot was taken (time.monotonic), for the hold-time estimate of Retry-After.
    since: float = field(default_factory=time.monotonic)
    # The partition whose keys hold it (routing/admission/partitions.py); "": the model's.
    part: str = ""
    # Tokens it reserves of its endpoint's budget (its id carries them too: slots.py).
    tokens: int = 0

    @property
    def keys(self) -> str:
        """The name of the slots that hold it: the model, or one of its partitions."""
        return self.part or self.model


@dataclass(slots=True)
class Waiter:
    """A request of this replica waiting in a model's (or a partition's) queue."""

    model: str  # the slots' name: the model, or one of its partitions
    future: asyncio.Future[str]
    # Its place in the queue, once Redis has confirmed it (rank x RANK + sequence).
    place: int | None = None
    # When (the admission's clock) the last call left that found it still queued (its
    # acquire, a sweep): a grant comes after, so it lasts its claim time from then at least
    # (routing/admission/waiting.py `wait`).
    kept: float = 0.0
    # Redis's clock (ms) when a sweep last found it queued, or queued it again: a grant whose
    # wake-up says an earlier time was undone since (routing/admission/wakeups.py `wake`).
    queued_ms: int = 0


@dataclass(slots=True)
class Orphan:
    """An id whose state in Redis is in doubt: to be forgotten there."""

    model: str | None  # the model (or partition) whose keys may hold it (lease or waiter)
    account: str | None  # the account key whose count may hold it
    rounds: int = FORGET_ROUNDS
    since: float = field(default_factory=time.monotonic)


@dataclass
class Holdings:
    held: dict[str, Lease] = field(default_factory=dict)
    waiters: dict[str, Waiter] = field(default_factory=dict)
    # Walks in progress that hold an entry in their account's count: id -> account key.
    walking: dict[str, str] = field(default_factory=dict)
    # Acquires sent and not answered yet: id -> the slots' name (the model, or a partition).
    # Redis may have run them (a lease of this replica's, not held here yet).
    acquiring: dict[str, str] = field(default_factory=dict)
    orphans: dict[str, Orphan] = field(default_factory=dict)
    # Walks from their start to their end: id -> account key; and the number of the last
    # begun (ids are "<replica>-<n>~..."): what Redis holds of a lower number that is not
    # held here nor under way is no one's (a failover lost its release: `purging`).
    walks: dict[str, str] = field(default_factory=dict)
    issued: int = -1
    # Accounts this replica took or gave back an entry of lately: key -> when (monotonic),
    # oldest first (`_saw`; `forget_seen` drops the old). Entries a failover brought back
    # live a TTL after their last keep, though no request of the account is left here to
    # keep them (routing/admission/accountkeeps.py).
    seen: dict[str, float] = field(default_factory=dict)

    def begin(self, number: int, lease_id: str, account: str) -> None:
        """A walk begins (its id's number, its id, its account's key)."""
        self.walks[lease_id] = account
        self.issued = max(self.issued, number)
        self._saw(account)

    def _saw(self, account: str) -> None:
        self.seen.pop(account, None)  # (to the end: the oldest stay first)
        self.seen[account] = time.monotonic()

    def end(self, lease_id: str) -> str | None:
        """A walk ends: the account key of its entry if it still holds one (not admitted)."""
        self.waiters.pop(lease_id, None)
        self.walks.pop(lease_id, None)
        return self.walking.pop(lease_id, None)

    def released(self, lease: Lease) -> None:
        self.held.pop(lease.id, None)
        self._saw(lease.account)

    def forget_seen(self, horizon_s: float) -> None:
        """Forget accounts seen longer than `horizon_s` ago: O(those), oldest first."""
        now = time.monotonic()
        while self.seen and now - self.seen[account := next(iter(self.seen))] > horizon_s:
            del self.seen[account]

    def purging(self, named: Iterable[str]) -> tuple[int, list[str]]:
        """What a sweep that names every waiter (`named`) and lease needs to take out of
        Redis what this replica no longer holds: the number its ids reached, and the walks
        under way it does not name (they may hold a lease or a place not known here yet)."""
        skip = set(named)
        return self.issued, [i for i in self.walks if i not in skip]

    def spare_of_accounts(self) -> dict[str, list[str]]:
        """Per account key, the ids of walks under way that `entries_by_account` does not
        name (an entry they took may not be known here yet)."""
        named = {i for ids in self.entries_by_account().values() for i in ids}
        found: dict[str, list[str]] = defaultdict(list)
        for lease_id, account in self.walks.items():
            if lease_id not in named:
                found[account].append(lease_id)
        for lease in self.held.values():
            if lease.id not in named:
                found[lease.account].append(lease.id)
        return found

    def is_live(self, lease_id: str) -> bool:
        """Whether this replica still holds `lease_id` (a request admitted or under way)."""
        return lease_id in self.held or lease_id in self.walking

    def doubt(self, lease_id: str, model: str | None, account: str | None) -> None:
        known = self.orphans.pop(lease_id, None)
        if known is not None:
            model = model or known.model
            account = account or known.account
        self.orphans[lease_id] = Orphan(model, account)
        while len(self.orphans) > MAX_ORPHANS:
            del self.orphans[next(iter(self.orphans))]  # the oldest

    def prune(self, max_age_s: float, now: float | None = None) -> None:
        """Drop in-doubt ids older than `max_age_s`: Redis has expired them by now."""
        now = time.monotonic() if now is None else now
        while self.orphans:
            oldest = next(iter(self.orphans))
            if now - self.orphans[oldest].since <= max_age_s:
                return
            del self.orphans[oldest]

    def holding(self, model: str) -> int:
        """Slots of `model` this replica holds (shared or local)."""
        return sum(1 for lease in self.held.values() if lease.model == model)

    def leases_by_model(self) -> dict[str, list[tuple[str, str]]]:
        """Leases by the slots that hold them; an outage's local lease once it is placed on
        an endpoint (its slot runs there: counted when Redis answers again)."""
        found: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for lease in self.held.values():
            if lease.endpoint:
                found[lease.keys].append((lease.id, lease.endpoint))
        return found

    def waiters_by_model(self) -> dict[str, list[tuple[str, int]]]:
        """Waiters Redis confirmed queued and not yet woken: (id, place)."""
        found: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for waiter_id, waiter in self.waiters.items():
            if waiter.place is not None and not waiter.future.done():
                found[waiter.model].append((waiter_id, waiter.place))
        return found

    def pending_by_model(self) -> dict[str, list[str]]:
        """Ids that may hold a lease in Redis that this replica does not hold yet: acquires
        not answered yet, and waiters woken whose request has not taken its lease yet."""
        found: dict[str, list[str]] = defaultdict(list)
        for lease_id, model in self.acquiring.items():
            found[model].append(lease_id)  # (never held yet: taken out before it is)
        for waiter_id, waiter in self.waiters.items():
            # (Once each: a waiter registers before its acquire leaves, so it may be woken
            # before that acquire is answered; its one lease counted twice would make this
            # replica's local outage share one more than it holds.)
            done = waiter.future.done()
            if done and waiter_id not in self.held and waiter_id not in self.acquiring:
                found[waiter.model].append(waiter_id)
        return found

    def entries_by_account(self) -> dict[str, list[str]]:
        """This replica's entries in each account's count: running and under way."""
        found: dict[str, list[str]] = defaultdict(list)
        for lease in self.held.values():
            if lease.endpoint:  # placed (local ones too: above)
                found[lease.account].append(lease.id)
        for lease_id, account in self.walking.items():
            found[account].append(lease_id)
        return found

    def orphans_by_model(self) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        """In-doubt ids by model and by account key."""
        models: dict[str, list[str]] = defaultdict(list)
        accounts: dict[str, list[str]] = defaultdict(list)
        for lease_id, orphan in self.orphans.items():
            if orphan.model is not None:
                models[orphan.model].append(lease_id)
            if orphan.account is not None:
                accounts[orphan.account].append(lease_id)
        return models, accounts

    def forgotten(self, ids: list[str]) -> None:
        """A sweep sent these in-doubt ids' forget and Redis answered."""
        for lease_id in ids:
            orphan = self.orphans.get(lease_id)
            if orphan is not None:
                orphan.rounds -= 1
                if orphan.rounds <= 0:
                    del self.orphans[lease_id]
