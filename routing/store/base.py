"""The `Store`: where admission's scripts run, whichever client carries it.

The one interface of the store: the clients that carry it (routing/store/resp.py `RespClient`,
routing/store/cluster.py `ClusterStore`, routing/store/connect.py `RedisPyStore`) import it,
and it imports none of them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from routing.store.wire import Command


class Store(Protocol):
    """Where admission scripts run (routing/store/scripts.py): `RespClient`, or `RedisPyStore`."""

    def send(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        """Send the commands in one round trip, now; the future gets one reply per command,
        a command's own error reply as an exception object in its place. A lost connection
        or a missed deadline fails the whole future; an argument that cannot be encoded
        fails it with `DataError` (nothing was sent)."""
        ...

    async def aclose(self) -> None: ...

    # How many times the store moved to another master (Sentinel); None where it cannot
    # tell. A write the old master took may be gone after a move (routing/ledger/recent.py).
    moves: int | None
    # Whether every key is on one server, so that one script may touch keys of several hash
    # tags (a model's and an account's): not on a Cluster.
    one_node: bool
