"""The usage records Redis took in the last seconds, kept for a store that can move to
another master (Sentinel).

Redis replicates asynchronously: a record the master took (and answered for) may not have
reached its replica when that replica is promoted, and then it is gone. When the store
moves to another master, the keeper spools these records again (routing/admission/keeper.py); a
record's identity makes the resend of one the new master already has a no-op
(routing/store/lua/usage.lua), so sending too many costs a little and never bills twice.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping

# Longer than a failover takes to be seen (the sentinels are asked every 0.5 s) plus the
# replication lag a healthy replica has; bounded in number, so in memory.
KEEP_S = 10.0
MOST = 20_000


class Recent:
    def __init__(
        self, keep_s: float = KEEP_S, most: int = MOST, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._keep_s = keep_s
        self._clock = clock
        self._records: deque[tuple[float, Mapping[str, str]]] = deque(maxlen=most)

    def took(self, record: Mapping[str, str]) -> None:
        """Redis answered that it took `record`."""
        self._records.append((self._clock(), record))
        self._forget_old()

    def lately(self) -> list[Mapping[str, str]]:
        """The records taken within the last `keep_s`, oldest first."""
        self._forget_old()
        return [record for _, record in self._records]

    def _forget_old(self) -> None:
        horizon = self._clock() - self._keep_s
        records = self._records
        while records and records[0][0] < horizon:
            records.popleft()
