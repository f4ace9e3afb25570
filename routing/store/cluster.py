"""The `Store` (routing/store/base.py) over a Redis Cluster: one client per master, each command
sent to the master of its first key's hash slot.

Every admission script touches one hash tag only (`gw:v2:{model}:...`, `gw:v2:acct:{<tag>}`,
`{usage}`), so it runs whole on one node. A batch for one master goes to it as it is; one
mixing tags of several masters is split, the parts leave at once (one round trip of
latency) and the replies are put back in the batch's order. `SCRIPT` commands go to every
master (each has its own script cache), keyless ones (`TIME`) to any.

The slot map comes from `CLUSTER SLOTS`. `MOVED` (the slot has another master) updates the
slot, refreshes the map in the background and resends there; `ASK` (the slot is migrating
and the key is on the target already) resends `ASKING` and the command to the target on one
connection; `TRYAGAIN` (a script's keys split mid-migration) is resent after a pause. None
of them means the command ran, so a resend never runs one twice.

A part that fails after it left (a node lost or stalled) fails the whole batch, in doubt for
the callers (routing/admission/handback.py). A part that never left (`NotSent`) did nothing: its
commands get that error in place, and the callers give back what the other parts took; when
no part left, the batch fails as `NotSent`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from redis.crc import REDIS_CLUSTER_HASH_SLOTS
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, RedisError, ResponseError

from routing.store.futures import chain
from routing.store.resp import NotSent
from routing.store.slotmap import EVERY, Node, redirect_of, slot_of
from routing.store.wire import Command, Transaction

if TYPE_CHECKING:
    from routing.store.base import Store

log = logging.getLogger("gateway.store")

# Rounds of redirects followed at least (more while the command timeout lasts), before a
# redirect stays as the command's error reply.
MAX_REDIRECTS = 5
# Between rounds of TRYAGAIN (a script whose keys are being migrated): doubling from 5 ms.
PAUSE_S = 0.005
MAX_PAUSE_S = 0.1


def _check_encodable(commands: Sequence[Command]) -> None:
    # Before any part leaves: a batch is sent whole or not at all.
    for command in commands:
        if isinstance(command, Transaction):
            _check_encodable(command)
            continue
        for arg in command:
            if isinstance(arg, str):
                arg.encode()


class ClusterStore:
    """A Redis Cluster, reached from any of its nodes (`seeds`). `connect(host, port)` gives
    the `Store` of one node (a `RespClient`, or redis-py for TLS). `patience_s`: how long
    redirects are followed past the first few (the command timeout)."""

    def __init__(
        self,
        seeds: Sequence[Node],
        connect: Callable[[str, int], Store],
        *,
        patience_s: float = 2.0,
    ) -> None:
        self._seeds = list(seeds)
        self._patience_s = patience_s
        self._connect = connect
        self._nodes: dict[Node, Store] = {}
        self._slots: list[Node | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        self._masters: list[Node] = []
        self._refreshing: asyncio.Task[None] | None = None
        self._lost_at = 0.0  # when a node found unreachable may ask for the map again
        self._tasks: set[asyncio.Future[Any]] = set()
        # Redirects followed, by kind (MOVED, ASK, TRYAGAIN): how often the map was behind.
        self.redirects: Counter[str] = Counter()
        # Slot maps in which a slot's master was gone (failed over): see `Store.moves`.
        self.moves: int | None = 0
        self.one_node = False

    # --- sending -------------------------------------------------------------------------

    def send(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        """The `Store` contract (routing/store/base.py), whatever node each command goes to."""
        loop = asyncio.get_running_loop()
        outer: asyncio.Future[list[Any]] = loop.create_future()
        try:
            slots = [slot_of(c) for c in commands]
            mapped = self._masters and all(s < 0 or self._slots[s] for s in slots)
            # The hot path: written in this tick, no task unless a reply redirects.
            if mapped and (node := self._one_node(slots)) is not None:  # no split
                sent = self.node(node).send(commands)  # its own DataError if need be
                sent.add_done_callback(partial(self._settle_one, commands, outer))
                return outer
            _check_encodable(commands)  # a split batch leaves whole or not at all
        except UnicodeError as exc:
            outer.set_exception(DataError(f"cannot encode a Redis argument: {exc}"))
            return outer
        # Commands for every master (SCRIPT LOAD) wait for a map being learned: a master
        # it adds (a MOVED to a new one asked for it) must not be left out.
        learning = self._refreshing is not None and not self._refreshing.done()
        if not mapped or (learning and EVERY in slots):
            return self._task(self._send_mapped(commands, slots))
        parts = self._dispatch(commands, slots)
        left = len(parts)

        def part_done(part: asyncio.Future[list[Any]]) -> None:
            nonlocal left
            self._check_lost(part)
            left -= 1
            if left == 0:
                self._settle(commands, slots, parts, outer)

        for _, future in parts:
            future.add_done_callback(part_done)
        if not parts:
            outer.set_result([])
        return outer

    def _one_node(self, slots: list[int]) -> Node | None:
        """The master every command goes to, when that is one master."""
        found: Node | None = None
        for slot in slots:
            if slot == EVERY:
                return None
            if slot >= 0:
                node = self._slots[slot]
                if found is not None and node != found:
                    return None
                found = node
        return found or self._masters[0]

    def _settle_one(
        self, commands: Sequence[Command], outer: asyncio.Future[list[Any]], sent: Any
    ) -> None:
        self._check_lost(sent)
        if outer.done():  # cancelled by whoever awaited it: the batch ran all the same
            return
        if sent.cancelled():
            outer.cancel()
        elif (exc := sent.exception()) is not None:
            outer.set_exception(exc)  # one node: whatever it means, as on a single Redis
        else:
            self._finish(commands, list(sent.result()), outer)

    def _check_lost(self, sent: asyncio.Future[list[Any]]) -> None:
        # An unreachable master answers no MOVED: after a failover only the map knows more
        # (asked at most once a second while a master stays down).
        lost = not sent.cancelled() and isinstance(sent.exception(), RedisConnectionError)
        if lost and (now := asyncio.get_running_loop().time()) >= self._lost_at:
            self._lost_at = now + 1.0
            self._refresh_soon()

    def _settle(
        self,
        commands: Sequence[Command],
        slots: list[int],
        parts: list[tuple[list[int], asyncio.Future[list[Any]]]],
        outer: asyncio.Future[list[Any]],
    ) -> None:
        if outer.done():  # cancelled by whoever awaited it: the parts ran all the same
            return
        try:
            replies = _assemble(len(commands), slots, parts)
        except RedisError as exc:
            outer.set_exception(exc)
            return
        self._finish(commands, replies, outer)

    def _finish(
        self, commands: Sequence[Command], replies: list[Any], outer: asyncio.Future[list[Any]]
    ) -> None:
        if not any(redirect_of(r) is not None for r in replies):
            outer.set_result(replies)
            return
        redirected = self._task(self._follow_all(commands, replies))
        redirected.add_done_callback(partial(chain, outer))

    async def _send_mapped(self, commands: Sequence[Command], slots: list[int]) -> list[Any]:
        """The first call, or one for a slot no master serves in the map known: ask the map."""
        try:
            await self.refresh()
        except RedisError as exc:
            raise NotSent(f"cannot learn the cluster's slots: {exc}") from exc
        parts = self._dispatch(commands, slots)
        if parts:
            await asyncio.wait([f for _, f in parts])
        return await self._follow_all(commands, _assemble(len(commands), slots, parts))

    def _dispatch(
        self, commands: Sequence[Command], slots: list[int]
    ) -> list[tuple[list[int], asyncio.Future[list[Any]]]]:
        """Each node's part of the batch, sent now: (the indices of its commands, its future).
        A command whose slot has no master is in no part."""
        by_node: dict[Node, list[int]] = {}
        keyed = next((self._slots[s] for s in slots if s >= 0 and self._slots[s]), None)
        for i, slot in enumerate(slots):
            for node in self._masters if slot == EVERY else [self._route(slot, keyed)]:
                if node is not None:
                    by_node.setdefault(node, []).append(i)
        return [
            (indices, self.node(node).send([commands[i] for i in indices]))
            for node, indices in by_node.items()
        ]

    async def _follow_all(self, commands: Sequence[Command], replies: list[Any]) -> list[Any]:
        """Follow redirects until none is left: at least `MAX_REDIRECTS` rounds, more while
        `patience_s` lasts (a slot being migrated answers TRYAGAIN until it is done)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._patience_s
        for hop in itertools.count():
            redirected = [i for i, r in enumerate(replies) if redirect_of(r) is not None]
            if not redirected or (hop >= MAX_REDIRECTS and loop.time() >= deadline):
                break
            waiting = any(str(replies[i]).startswith("TRYAGAIN") for i in redirected)
            if waiting or hop >= MAX_REDIRECTS:
                await asyncio.sleep(min(PAUSE_S * 2**hop, MAX_PAUSE_S))
            await self._follow(commands, replies, redirected)
        return replies

    async def _follow(
        self, commands: Sequence[Command], replies: list[Any], redirected: list[int]
    ) -> None:
        """Resend the redirected commands where their replies say, all at once; their new
        replies replace the redirects in `replies`. A part that never left answers its
        commands with `NotSent`; one that may have run fails the batch, in doubt."""
        by_node: dict[Node, list[Command]] = {}
        order: dict[Node, list[tuple[int, bool]]] = {}  # (index, whether ASKING precedes)
        for i in redirected:
            kind, slot, target = redirect_of(replies[i]) or ("", -1, None)
            self.redirects[kind] += 1
            if kind == "MOVED" and target is not None:
                self._slots[slot] = target
                self._refresh_soon()
            elif target is None:  # TRYAGAIN: the same slot, wherever the map says now
                target = self._route(slot_of(commands[i]), None)
            if target is None:
                continue  # no master for it: the TRYAGAIN stays its reply
            asking = kind == "ASK"
            sent = by_node.setdefault(target, [])
            sent += [["ASKING"], commands[i]] if asking else [commands[i]]
            order.setdefault(target, []).append((i, asking))
        futures = {node: self.node(node).send(cmds) for node, cmds in by_node.items()}
        if futures:
            await asyncio.wait(futures.values())
        for node, future in futures.items():
            if isinstance(exc := future.exception(), NotSent):  # never left: did nothing
                for i, _ in order[node]:
                    replies[i] = exc
                continue
            if exc is not None:
                raise exc  # it may have run: callers doubt the whole batch
            answered, at = future.result(), 0
            for i, asking in order[node]:
                at += 1 if asking else 0  # ASKING's own OK
                replies[i] = answered[at]
                at += 1

    def node_of_slot(self, slot: int) -> Node | None:
        """The master of `slot` in the map known now."""
        return self._slots[slot]

    def _route(self, slot: int, keyed: Node | None) -> Node | None:
        """The master for `slot` (a keyless command: the batch's first keyed node, or any)."""
        if slot >= 0:
            return self._slots[slot]
        return keyed or (self._masters[0] if self._masters else None)

    # --- the map -------------------------------------------------------------------------

    def node(self, node: Node) -> Store:
        store = self._nodes.get(node)
        if store is None:
            store = self._nodes[node] = self._connect(*node)
        return store

    def _refresh_soon(self) -> asyncio.Task[None]:
        """One `CLUSTER SLOTS` in flight at a time; its failure is logged, not raised."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh())
            self._refreshing.add_done_callback(_quiet)
        return self._refreshing

    async def refresh(self) -> None:
        """Learn the slot map now."""
        await asyncio.shield(self._refresh_soon())

    async def _refresh(self) -> None:
        last: Exception = RedisConnectionError("no cluster node known")
        for node in dict.fromkeys([*self._masters, *self._seeds]):
            try:
                (reply,) = await self.node(node).send([["CLUSTER", "SLOTS"]])
            except RedisError as exc:
                last = exc
                continue
            if isinstance(reply, Exception):
                last = reply
                continue
            self._learn(node[0], reply)
            return
        raise last

    def _learn(self, asked: str, reply: list[Any]) -> None:
        slots: list[Node | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        masters: dict[Node, None] = {}
        for start, end, master, *_replicas in reply:
            host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
            node = (host if host not in ("", "?") else asked, int(master[1]))
            masters[node] = None
            slots[int(start) : int(end) + 1] = [node] * (int(end) - int(start) + 1)
        pairs = zip(self._slots, slots, strict=True)
        if any(a is not None and b is not None and a != b and a not in masters for a, b in pairs):
            # A slot's master is no master any more: its replica took over, and what it took
            # lately may not have reached that replica (routing/ledger/recent.py).
            self.moves = (self.moves or 0) + 1
        self._slots, self._masters = slots, list(masters)

    # --- lifetime ------------------------------------------------------------------------

    def _task(self, work: Coroutine[Any, Any, list[Any]]) -> asyncio.Future[list[Any]]:
        # A strong reference while it runs: the loop keeps only a weak one.
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def aclose(self) -> None:
        # Calls on their way finish first (bounded): else they connect closed nodes again.
        while self._tasks:
            await asyncio.wait(list(self._tasks))
        if self._refreshing is not None and not self._refreshing.done():
            self._refreshing.cancel()
        for store in self._nodes.values():
            await store.aclose()
        self._nodes.clear()


_UNSERVED = object()  # a command no master was found for


def _assemble(
    count: int, slots: list[int], parts: list[tuple[list[int], asyncio.Future[list[Any]]]]
) -> list[Any]:
    """The parts' replies (all done) in the batch's order: for a command sent to every
    master, the first error (a NotSent last), else the first reply; for one no master
    serves, CLUSTERDOWN; for those of a part that never left, its `NotSent`."""
    failed = [e for _, f in parts if (e := f.exception()) is not None]
    if failed:
        if len(failed) == len(parts) and all(isinstance(e, NotSent) for e in failed):
            raise failed[0]
        if doubt := next((e for e in failed if not isinstance(e, NotSent)), None):
            raise doubt  # it may have run: callers doubt the whole batch
    replies: list[Any] = [_UNSERVED] * count
    for indices, future in parts:
        exc = future.exception()
        answered = [exc] * len(indices) if exc is not None else future.result()
        for i, reply in zip(indices, answered, strict=True):
            have = replies[i]  # a node down (NotSent: did nothing) gives way to any reply
            error = isinstance(reply, Exception) and not isinstance(reply, NotSent)
            if (
                have is _UNSERVED
                or isinstance(have, NotSent)
                or (error and not isinstance(have, Exception))
            ):
                replies[i] = reply
    for i, reply in enumerate(replies):
        if reply is _UNSERVED:
            replies[i] = ResponseError(f"CLUSTERDOWN Hash slot {slots[i]} not served")
    return replies


def _quiet(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.debug("cluster slot map refresh failed: %s", exc)
