"""Which accounts' entries a sweep keeps (routing/admission/keeper.py).

Each request running or waiting holds an entry in its account's count (`gw:acct:{account}`,
one key per account, each behind its own hash tag), which lives the lease TTL unless its
replica keeps it. Keeping every account at every sweep cost one script call per account a
second: with 10,000 accounts waiting, 5,000 calls per replica a second, most of Redis's
work for a queue that deep (bench/README.md). An account is kept when:

- it holds an entry no sweep kept yet, or kept for the first time less than RECENT rounds
  ago: what a failover to a replica that lagged a few seconds behind (or an AOF's last
  second) may have lost is written back at once, as before;
- its last keep was `every` rounds ago: far inside the entries' TTL (a third of it);
- Redis lost this replica's state (its heartbeat found it gone: a restart empty, a failover
  that lost more than the RECENT rounds), an account's keep found entries gone, or the store
  moved to another master: then every account, at the next sweep.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# Rounds during which an entry is kept at every sweep after its first keep: longer than
# the writes a failover may lose (a replica's lag, an AOF's last second). A loss of more
# makes this replica's heartbeat, written every round and living 3 rounds, go too.
RECENT = 3


class AccountKeeps:
    def __init__(self, every: int) -> None:
        self.every = max(1, every)
        self._last: dict[str, int] = {}  # account key -> the round of its last keep
        self._first: dict[str, int] = {}  # entry id -> the round of its first keep
        self._all = True  # the next round keeps every account
        self._again = False  # a keep of the round found entries gone

    @classmethod
    def of(cls, ttl_ms: int, interval_s: float) -> AccountKeeps:
        """Kept at least three times within the entries' TTL."""
        return cls(int(ttl_ms / 1000 / max(interval_s, 0.001) / 3))

    def due(self, entries: Mapping[str, Sequence[str]], round_: int) -> tuple[list[str], bool]:
        """The accounts the round `round_` keeps, and whether that is all of them."""
        held = {i for ids in entries.values() for i in ids}
        self._first = {i: r for i, r in self._first.items() if i in held}
        self._last = {key: r for key, r in self._last.items() if key in entries}
        if self._all:
            return list(entries), True
        keys = [
            key
            for key, ids in entries.items()
            if round_ - self._last.get(key, round_ - self.every) >= self.every
            or any(round_ - self._first.get(i, round_) < RECENT for i in ids)
        ]
        return keys, False

    def kept(self, key: str, ids: Sequence[str], round_: int, restored: bool) -> None:
        """Redis answered the keep of `key` sent in round `round_`; `restored`: it had to
        write some of them back (Redis lost them: every account is kept next)."""
        self._last[key] = round_
        for i in ids:
            self._first.setdefault(i, round_)
        self._again = self._again or restored

    def done(self, full: bool, answered: bool) -> None:
        """The round's keeps were answered (`answered`: all of them); `full`: it kept every
        account."""
        if full and answered:
            self._all = False
        self._all = self._all or self._again
        self._again = False

    def wants_all(self) -> bool:
        """Whether the next keep is of every account (Redis lost some)."""
        return self._all

    def lost(self) -> None:
        """Redis lost this replica's state: every account at the next round."""
        self._all = True
