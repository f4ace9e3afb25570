"""Which accounts' entries a sweep keeps (routing/admission/keeper.py).

Each request running or waiting holds an entry in its account's count (`gw:acct:{<tag>}`,
one key per account, each behind its own hash tag), which lives the lease TTL unless its
replica keeps it. Keeping every account at every sweep cost one script call per account a
second: with 10,000 accounts waiting, 5,000 calls per replica a second, most of Redis's
work for a queue that deep (bench/README.md). An account is kept when:

- it holds an entry no sweep kept yet: what a failover to a replica that lagged behind (or
  an AOF's last second) lost of it is written back at once, as before (those entries only).
  One keep is enough: each round's heartbeat goes after its keeps and leaves a mark, and
  the next finds it there (Redis applies writes in order, and a replica copies them so)
  unless Redis lost that round's keeps, or anything written before them;
- its last keep was `every` rounds ago, or a third of the entries' TTL ago, whichever comes
  first: rounds run late when Redis is slow to answer or the loop is busy (each starts an
  interval after the last ended), and `every` late rounds may outlast the TTL;
- Redis lost this replica's state (its heartbeat did not find the last one's mark: a
  restart empty, a failover that lost a round's keeps; or a round failed whole, its
  heartbeat's answer unknown), an account's keep found entries gone, or the store moved
  to another master: then every account, at the next sweep.

On a Redis Cluster every account is kept at every round: the heartbeat lives on one node
and cannot tell that another master restarted empty.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from routing.store.keys import BEAT_PREFIX
from routing.store.scripts import Call, first_error
from routing.store.wire import text

if TYPE_CHECKING:
    from routing.admission.admit import Admission

# Rounds during which an entry is kept at every sweep after its first keep. One: the keeps
# of a round are vouched for by its heartbeat's mark (`beat`), and an entry written after
# them is kept at the next round (its acquire was answered after this round's snapshot).
# Three before the mark, when a heartbeat only said whether Redis knew this replica: a
# failover that lost less than its life (3 rounds) went unseen.
RECENT = 1
# On one Redis this many accounts go in one keep (a script call per account cost about three
# times its work); on a Cluster one, every account its own hash tag.
PER_CALL = 500


class AccountKeeps:
    def __init__(self, every: int, every_s: float = math.inf, lag_ms: int = 0) -> None:
        self.every = max(1, every)
        self.every_s = every_s
        # How much longer than the lease TTL a keep makes its entries live: an account not
        # due is not kept while the sweeps keep its leases, up to `every_s` (and a keep's
        # time on its way) after its last keep. Its entries must outlive those leases: a
        # replica stopped (SIGSTOP, a stalled loop) longer than the TTL less that lag, not
        # longer than the TTL, still runs them, and its accounts' limits must count them.
        self.lag_ms = 0 if self.every == 1 else lag_ms
        self._last: dict[str, int] = {}  # account key -> the round of its last keep
        self._at: dict[str, float] = {}  # account key -> when its last keep left (a clock)
        self._first: dict[str, int] = {}  # entry id -> the round of its first keep
        self._all = True  # the next round keeps every account
        self._again = False  # a keep of the round found entries gone
        # The mark the last heartbeat answered left, which the next must find (None: not
        # known, every account is kept next anyway).
        self._mark: str | None = None

    @classmethod
    def of(cls, ttl_ms: int, interval_s: float, timeout_ms: int = 0) -> AccountKeeps:
        """Kept at least three times within the entries' TTL."""
        every_s = ttl_ms / 1000 / 3
        lag_ms = math.ceil(every_s * 1000) + timeout_ms
        return cls(int(ttl_ms / 1000 / max(interval_s, 0.001) / 3), every_s, lag_ms)

    def due(
        self, entries: Mapping[str, Sequence[str]], round_: int, now: float | None = None
    ) -> tuple[list[tuple[str, list[str], bool]], bool]:
        """What the round `round_` keeps: per account its ids to keep and whether those are
        all of its ids (due, or every account is); and whether that is every account. An
        account kept only for its recent entries sends those alone: one account with
        thousands of requests would otherwise send them all at every round. `now`: when
        the round leaves (the clock of `kept`'s `at`)."""
        held = {i for ids in entries.values() for i in ids}
        self._first = {i: r for i, r in self._first.items() if i in held}
        self._last = {key: r for key, r in self._last.items() if key in entries}
        self._at = {key: t for key, t in self._at.items() if key in entries}
        if self._all:
            return [(key, list(ids), True) for key, ids in entries.items()], True
        kept: list[tuple[str, list[str], bool]] = []
        for key, ids in entries.items():
            if self._due(key, round_, now):
                kept.append((key, list(ids), True))
            elif recent := [i for i in ids if round_ - self._first.get(i, round_) < RECENT]:
                kept.append((key, recent, False))
        return kept, False

    def _due(self, key: str, round_: int, now: float | None) -> bool:
        if round_ - self._last.get(key, round_ - self.every) >= self.every:
            return True
        return now is not None and key in self._at and now - self._at[key] >= self.every_s

    def kept(
        self,
        key: str,
        ids: Sequence[str],
        round_: int,
        whole: bool,
        restored: bool,
        at: float | None = None,
    ) -> None:
        """Redis answered the keep of `ids` of `key` sent in round `round_` (`whole`: all of
        its ids), which left at `at`; `restored`: it had to write some back (Redis lost them:
        every account is kept next, unless this round kept every account)."""
        if whole:
            self._last[key] = round_
            if at is not None:
                self._at[key] = at
        for i in ids:
            self._first.setdefault(i, round_)
        self._again = self._again or restored

    def done(self, full: bool, answered: bool) -> None:
        """The round's keeps were answered (`answered`: all of them); `full`: it kept every
        account."""
        if full and answered:
            self._all = False  # (every account was written back where it had to be)
        else:
            self._all = self._all or self._again
        self._again = False

    def wants_all(self) -> bool:
        """Whether the next keep is of every account (Redis lost some)."""
        return self._all

    def lost(self) -> None:
        """Redis lost this replica's state: every account at the next round."""
        self._all = True
        self._mark = None  # (the round's heartbeat may have run or not)

    def beat(self, sent: str, found: str | None) -> None:
        """A heartbeat, sent after a round's keeps, left the mark `sent` and found `found`:
        anything but the last one's mark means Redis lost writes (a restart, a failover to
        a replica that lagged), perhaps keeps: every account at the next round."""
        if self._mark is not None and found != self._mark:
            self._all = True
        self._mark = sent


@dataclass
class Batch:
    """One round's keeps: the accounts, the ids of each, and the calls carrying them."""

    keys: list[str]
    entries: list[list[str]]
    whole: list[bool]  # per account: all of its ids
    everyone: bool  # every account this replica holds entries in
    number: int  # the round
    sent: float  # when it left (the admission's waiting clock)
    calls: list[Call]


class AccountKeeper:
    """The accounts' keeps of a replica's sweeps: which (`AccountKeeps`), in what calls, and
    what their answers say."""

    def __init__(self, admission: Admission, interval_s: float) -> None:
        self.admission = admission
        # On a Cluster the heartbeat vouches for its own node alone: a master restarted empty
        # (same address, no failover: `moves` unchanged) that holds accounts' keys but not
        # gw:replicas lost them unseen. Every account at every round there.
        self.keeps = (
            AccountKeeps.of(
                admission.timing.lease_ttl_ms, interval_s, admission.timing.command_timeout_ms
            )
            if admission.store.one_node
            else AccountKeeps(1)
        )
        self._moves = 0  # the store's moves to another master seen
        self._beats = 0  # heartbeats sent (each one's mark)
        self._answered = False  # a heartbeat was answered (`answered_beat`)

    def batch(self, number: int) -> Batch:
        """The keeps of round `number`: on one Redis PER_CALL accounts a call, on a Cluster
        (each account its own hash tag) one."""
        adm = self.admission
        if (moves := adm.store.moves) is not None and moves != self._moves:
            self._moves = moves
            self.keeps.lost()  # another master: it may lack what the last one had
        sent, holdings = adm.waiting.clock(), adm.holdings
        entries = holdings.entries_by_account()
        holdings.forget_seen(self._horizon_s())
        for key in holdings.seen if self.keeps.wants_all() else ():
            entries.setdefault(key, [])  # (what a lost write brought back goes: `_calls`)
        due, everyone = self.keeps.due(entries, number, sent)
        keys, kept, whole = [k for k, _, _ in due], [i for _, i, _ in due], [w for _, _, w in due]
        return Batch(keys, kept, whole, everyone, number, sent, self._calls(keys, kept, everyone))

    def _calls(self, keys: list[str], kept: list[list[str]], everyone: bool) -> list[Call]:
        """The keeps' calls; keeping every account (Redis may have lost writes), each also
        takes out the entries of this replica's ids that it no longer holds."""
        adm, per = self.admission, self._per_call()
        issued, spare = adm.holdings.issued, adm.holdings.spare_of_accounts() if everyone else {}
        head: list[Any] = [adm.timing.lease_ttl_ms + self.keeps.lag_ms]
        head += [adm.replica_id, issued] if everyone else ["", ""]
        calls: list[Call] = []
        for at in range(0, len(keys), per):
            args = list(head)
            for key, ids in zip(keys[at : at + per], kept[at : at + per], strict=True):
                args += (len(ids), *ids)
                if everyone:
                    args += (len(spare.get(key, [])), *spare.get(key, []))
            calls.append(("account_keep", keys[at : at + per], args))
        return calls

    def _horizon_s(self) -> float:
        """How long an entry a failover brought back may live: the TTL a keep gives it, an
        interval and a command's timeout."""
        t = self.admission.timing
        return (t.lease_ttl_ms + self.keeps.lag_ms + t.command_timeout_ms) / 1000 + 2

    def answered(self, batch: Batch, replies: Sequence[Any]) -> None:
        """The batch's replies, one per call: entries written back are given back where this
        replica no longer holds them (`recheck`), and what was kept is remembered."""
        per_key: list[Any] = []
        for (_, keys, _), reply in zip(batch.calls, replies, strict=False):
            # (a call's error stands for each of its accounts)
            per_key += reply if isinstance(reply, list) else [reply] * len(keys)
        for key, ids, whole, reply in zip(
            batch.keys, batch.entries, batch.whole, per_key, strict=False
        ):
            self.admission.handback.recheck(reply, None, key)
            if not isinstance(reply, Exception):
                self.keeps.kept(key, ids, batch.number, whole, bool(reply), batch.sent)
        answered = len(replies) == len(batch.calls) and first_error(replies) is None
        self.keeps.done(batch.everyone, answered)

    def heartbeat(self, replicas_key: str) -> tuple[Call, str]:
        """This replica's heartbeat, sent after the keeps it vouches for, and its mark (on a
        Cluster none: the heartbeat's node is not the accounts')."""
        adm = self.admission
        self._beats += 1
        mark = str(self._beats)
        args: list[Any] = [adm.replica_id, adm.timing.waiter_ttl_ms]
        if not adm.store.one_node:
            return ("heartbeat", [replicas_key], args), mark
        keys = [replicas_key, BEAT_PREFIX + adm.replica_id]
        return ("heartbeat", keys, [*args, mark, 2 * adm.timing.lease_ttl_ms]), mark

    def answered_beat(self, mark: str, reply: Any) -> None:
        """A heartbeat's answer (`reply`, or its error), which left `mark`."""
        if isinstance(reply, Exception):
            self.keeps.lost()  # it may have run or not: its mark is not known
            return
        gone, _, found = reply
        if int(gone) == 1 and self._answered:
            self.keeps.lost()  # Redis restarted empty, or failed over far behind
        self._answered = True
        if self.admission.store.one_node:
            self.keeps.beat(mark, text(found) if found else None)

    def _per_call(self) -> int:
        return PER_CALL if self.admission.store.one_node else 1
