"""Which waiters a replica's sweeps name (routing/admission/keeper.py).

Naming a waiter: its sweep reads its place; one Redis lost is queued again at its place, one
granted whose wake-up was lost has its grant claimed (sweep.lua). Each costs the sweep an
argument pair and a lookup, and a waiter's liveness costs nothing (it lives by its replica's
entry in `alive`, prelude `live`), so a waiter is named:

- once, at the first sweep after its acquire was answered. Redis applies writes in order,
  and a replica of it copies them so: the score a sweep writes in `alive`, found again by
  the next sweep, vouches for everything written before it. Only what was queued since may
  have been lost unseen, and that is what the next sweep names;
- with every other waiter, when Redis may have lost any: a sweep found another score than
  the last one wrote (it says so, `Sweep.name`: they are named at once, by a second call),
  a round failed (its replies, or Redis's writes, unknown), the subscription is down or
  just (re)started (wake-ups are lost while it is down: routing/admission/wakeups.py), the
  store moved to another master;
- with every other waiter every NAME_EVERY rounds anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from routing.admission.timing import NAME_EVERY
from routing.admission.wakeups import Wakeups

Waiters = Mapping[str, Sequence[tuple[str, int]]]  # per partition: (waiter id, place)


class Naming:
    def __init__(self, wakeups: Wakeups, waiter_ttl_ms: int) -> None:
        self.wakeups = wakeups
        self.waiter_ttl_ms = waiter_ttl_ms
        self._next = 0  # the next this many rounds name every waiter
        self._gaps = 0  # the subscription's starts answered
        self._moves = 0  # the store's moves answered
        self._named: set[tuple[str, int]] = set()  # (waiter, place) a sweep sent named
        self._alive: dict[str, int] = {}  # partition -> the `alive` score its last sweep wrote
        # The last round chosen names every waiter because the store moved to another
        # master (which may have lost writes): its sweeps take out what no one holds.
        self.purge = False

    def choose(
        self, round_: int, waiters: Waiters, moves: int
    ) -> tuple[bool, dict[str, list[tuple[str, int]]]]:
        """Whether round `round_` names every waiter, and those it names, per partition, of
        this replica's `waiters`; `moves`: the store's moves to another master so far."""
        every = self._every(round_, moves)
        named = self._named
        chosen = {part: [w for w in ws if every or w not in named] for part, ws in waiters.items()}
        self._named = {w for ws in waiters.values() for w in ws}
        return every, {part: ws for part, ws in chosen.items() if ws}

    def _every(self, round_: int, moves: int) -> bool:
        gaps = self.wakeups.gaps
        every = (round_ % NAME_EVERY == 0 or self._next > 0 or gaps != self._gaps
                 or moves != self._moves or not self.wakeups.listening)  # fmt: skip
        if gaps != self._gaps:
            # One round more: a grant published before the subscription was made in Redis
            # may come after the round's sweep ran.
            self._next = max(self._next, 2)
        self.purge = moves != self._moves
        if moves != self._moves:
            self.wakeups.moved()
            self._alive.clear()  # another master: its scores are not the last one's
        self._gaps, self._moves = gaps, moves
        self._next = max(0, self._next - 1)
        return every

    def guard(self) -> int:
        """A round is sent: until it ends well, the next names every waiter (Redis may have
        lost some unseen). Returns what `ended` restores."""
        due = self._next
        self._next = max(due, 1)
        return due

    def ended(self, due: int) -> None:
        """The round sent after `guard` ended well."""
        self._next = due

    def alive(self, part: str) -> int | None:
        """The `alive` score this replica's last sweep of `part` answered wrote (None: not
        known)."""
        return self._alive.get(part)

    def swept(self, part: str, clock_ms: int) -> None:
        """A sweep of `part` answered, run at Redis's `clock_ms` (0: a release's sweep that
        does not say)."""
        if clock_ms:
            self._alive[part] = clock_ms + self.waiter_ttl_ms
        else:
            self._alive.pop(part, None)
