"""The Redis side of admission: the Lua scripts and the keys of one model, as typed calls.

Keys of one model share the hash tag `{model}` (one Redis Cluster slot per script call);
times come from Redis `TIME` inside the scripts, never from a replica's clock.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from routing.resp import RespClient
from tiers.policy import Tier

GRANTED, QUEUED, BUSY, FULL = 1, 2, 0, -1


def _lua(name: str) -> str:
    return resources.files("routing").joinpath("lua", name).read_text(encoding="utf-8")


# One script call: (script name, KEYS, ARGV), to run alone or batched in one round trip.
Call = tuple[str, Sequence[str], Sequence[Any]]

_PRELUDED = ("acquire", "release", "cancel", "sweep")
_PLAIN = ("refresh", "account", "heartbeat", "usage")


class Scripts:
    """The Lua scripts, registered once with SCRIPT LOAD and run by EVALSHA.

    Not redis-py's `register_script`: its pipelines ask SCRIPT EXISTS before every execute,
    a second round trip on the hot path. Here a NOSCRIPT reply (Redis restarted) reloads.
    """

    def __init__(self) -> None:
        prelude = _lua("prelude.lua")
        self._text = {n: prelude + _lua(f"{n}.lua") for n in _PRELUDED}
        self._text.update({n: _lua(f"{n}.lua") for n in _PLAIN})
        self.sha = {n: hashlib.sha1(t.encode()).hexdigest() for n, t in self._text.items()}  # noqa: S324

    async def load(self, client: Store) -> None:
        if isinstance(client, RespClient):
            replies = await client.send([("SCRIPT", "LOAD", t) for t in self._text.values()])
            shas = [r.decode() if isinstance(r, bytes) else r for r in replies]
        else:
            shas = [await client.script_load(t) for t in self._text.values()]
        for name, sha in zip(self._text, shas, strict=True):
            if isinstance(sha, Exception):
                raise sha
            if sha != self.sha[name]:
                raise RuntimeError(f"script {name}: Redis computed another sha1")

    async def run(self, client: Store, call: Call) -> Any:
        return (await self.submit(client, [call]))[0]

    async def execute(self, client: Store, calls: Sequence[Call]) -> list[Any]:
        return await self.submit(client, calls)

    def submit(self, client: Store, calls: Sequence[Call]) -> asyncio.Future[list[Any]]:
        """Send several calls in one round trip, now; the future gets their replies.

        A call names one of the scripts, or else a plain Redis command (e.g. ZREM). The
        calls are on their way even if whoever awaits the future is cancelled.
        """
        if not isinstance(client, RespClient):
            return asyncio.ensure_future(self._pipeline(client, calls))
        outer: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        sent = client.send(self._commands(calls))
        sent.add_done_callback(lambda done: self._settle(client, calls, done, outer))
        return outer

    def _commands(self, calls: Sequence[Call]) -> list[list[Any]]:
        commands = []
        for name, keys, args in calls:
            sha = self.sha.get(name)
            if sha is None:
                commands.append([name, *keys, *args])
            else:
                commands.append(["EVALSHA", sha, len(keys), *keys, *args])
        return commands

    def _settle(
        self,
        client: RespClient,
        calls: Sequence[Call],
        done: asyncio.Future[list[Any]],
        outer: asyncio.Future[list[Any]],
    ) -> None:
        if outer.done():
            return
        if done.cancelled():
            outer.cancel()
            return
        if (exc := done.exception()) is not None:
            outer.set_exception(exc)
            return
        replies = done.result()
        if any(isinstance(r, NoScriptError) for r in replies):
            # Redis lost its scripts (restart, SCRIPT FLUSH): load them, then try once more.
            retry = asyncio.ensure_future(self._reload_and_send(client, calls))
            retry.add_done_callback(lambda again: _chain(again, outer))
            return
        error = next((r for r in replies if isinstance(r, Exception)), None)
        if error is not None:
            outer.set_exception(error)
        else:
            outer.set_result(replies)

    async def _reload_and_send(self, client: RespClient, calls: Sequence[Call]) -> list[Any]:
        await self.load(client)
        replies = await client.send(self._commands(calls))
        error = next((r for r in replies if isinstance(r, Exception)), None)
        if error is not None:
            raise error
        return replies

    async def _pipeline(self, client: aioredis.Redis, calls: Sequence[Call]) -> list[Any]:
        for retry in (False, True):
            pipe = client.pipeline(transaction=False)
            for command in self._commands(calls):
                pipe.execute_command(*command)
            try:
                return list(await pipe.execute())
            except NoScriptError:
                if retry:
                    raise
                await self.load(client)
        raise AssertionError("unreachable")


# Where the scripts run: the lean pipelining client, or redis-py (memory://, TLS).
Store = RespClient | aioredis.Redis


def _chain(source: asyncio.Future[list[Any]], target: asyncio.Future[list[Any]]) -> None:
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif (exc := source.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


@dataclass(frozen=True, slots=True)
class Attempt:
    status: int
    endpoint: str
    inflight: int
    # Waiters ahead of this request (for BUSY/QUEUED) or the queue depth (for FULL).
    ahead: int


@dataclass(frozen=True, slots=True)
class ModelState:
    inflight: int
    queued: dict[Tier, int]
    freed: int


def account_key(account: str) -> str:
    return "gw:acct:{" + account + "}"


class ModelSlots:
    """One model's slots in Redis: its keys and the script calls on them.

    The endpoints in rotation (healthy ones) and so the capacity and tier ceilings change
    with health; the script arguments are rebuilt then, not per request.
    """

    def __init__(
        self, model: str, utilization: dict[Tier, float], max_queue: int, ttl_ms: int
    ) -> None:
        tag = "gw:{" + model + "}:"
        self.model = model
        self.keys = [
            tag + k for k in ("leases", "queue", "ep_of", "ep_load", "seq", "freed", "qexp")
        ]
        self.channel = tag + "wake"
        self._ttl = ttl_ms
        self.configure(utilization, max_queue)
        self.set_endpoints([])

    def configure(self, utilization: dict[Tier, float], max_queue: int) -> None:
        """Tier ceilings and queue bound (set again by a config reload)."""
        self.max_queue = max_queue
        self._utilization = [utilization[t] for t in (Tier.PRIORITY, Tier.DEFAULT, Tier.FLEX)]
        if hasattr(self, "_spec"):
            self.set_endpoints([(u, *self._spec[u]) for u in self.urls])

    def set_endpoints(self, endpoints: Sequence[tuple[str, int, float]]) -> None:
        """The endpoints in rotation: (url, max_concurrency, load penalty)."""
        self.capacity = sum(size for _, size, _ in endpoints)
        self.urls = [url for url, _, _ in endpoints]
        self._ceilings = [self.capacity * u for u in self._utilization]
        self._spec = {url: (size, penalty) for url, size, penalty in endpoints}
        self._endpoints = self._args(self.urls)
        # Ties in load go to the first endpoint listed: acquires take turns at the order.
        self._rotations = [self._args(self.urls[i:] + self.urls[:i]) for i in range(len(self.urls))]
        self._turn = 0

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
        wait_ms: int,
        affinity: Sequence[str] | None = None,
        only: Sequence[str] | None = None,
    ) -> Call:
        """`affinity`: take the first of these endpoints with room (prefix-cache order);
        `only`: the least loaded among these; else the least loaded of all."""
        mode, endpoints = "least", self._endpoints
        if self._rotations:
            self._turn = (self._turn + 1) % len(self._rotations)
            endpoints = self._rotations[self._turn]
        if affinity:
            mode, endpoints = "first", self._args([u for u in affinity if u in self._spec])
        elif only is not None:
            endpoints = self._args([u for u in only if u in self._spec])
        args = [lease_id, self._ttl, tier.rank, int(may_wait), self.max_queue, wait_ms,
                self.channel, mode, *self._ceilings, *endpoints]  # fmt: skip
        return ("acquire", self.keys, args)

    def release(self, lease_id: str) -> Call:
        args = [lease_id, self._ttl, self.channel, *self._ceilings, *self._endpoints]
        return ("release", self.keys, args)

    def cancel(self, waiter_id: str) -> Call:
        """Reply: '' if the waiter was still queued (now removed), else its granted endpoint."""
        return ("cancel", self.keys, [waiter_id])

    def sweep(self) -> Call:
        return ("sweep", self.keys, [self._ttl, self.channel, *self._ceilings, *self._endpoints])

    def refresh(self, lease_ids: Sequence[str]) -> Call:
        return ("refresh", self.keys[:1], [self._ttl, *lease_ids])

    @property
    def granted_key(self) -> str:
        """The lease -> endpoint hash, where a grant whose message was lost can be found."""
        return self.keys[2]


def attempt(reply: Sequence[Any]) -> Attempt:
    return Attempt(int(reply[0]), text(reply[1]), int(reply[2]), int(reply[3]))


def model_state(reply: Sequence[Any]) -> ModelState:
    queued = {Tier.PRIORITY: int(reply[1]), Tier.DEFAULT: int(reply[2]), Tier.FLEX: int(reply[3])}
    return ModelState(int(reply[0]), queued, int(reply[4]))


def text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return "" if value is None else str(value)
