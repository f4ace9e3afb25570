"""The Lua scripts of admission, registered once and run by EVALSHA, in batches.

A batch is several calls sent in one round trip. Its replies come back one per call, with
a call's own error reply (a NOSCRIPT, an OOM refusal, a script error) as an exception
object in its place, so that whoever sent the batch can give back what the other calls
took. A lost connection or a missed deadline fails the whole batch instead. Batches go
through a `Store` (routing/store/base.py), whichever client carries it.

Not redis-py's `register_script`: its pipelines ask SCRIPT EXISTS before every execute, a
second round trip on the hot path. Here a NOSCRIPT reply (Redis restarted empty) reloads the
scripts and resends only the calls that got it: the others already ran and must not run
twice (a second `account` call would count the request twice).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Sequence
from functools import partial
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError, RedisError

from routing.store.base import Store
from routing.store.futures import chain
from routing.store.resp import NotSent
from routing.store.wire import Command, Transaction

# One script call: (script name, KEYS, ARGV); a name that is not a script is sent as a plain
# Redis command (e.g. ZREM) with KEYS and ARGV as its arguments; `TRANSACTION` with no KEYS
# and calls as ARGV runs those all or none (routing/store/wire.py `Transaction`), one reply.
Call = tuple[str, Sequence[str], Sequence[Any]]
TRANSACTION = "MULTI"

# What a failed call raises: Redis did not do it, or may not have (the outage answers).
STORE_ERRORS = (RedisError, OSError)

_PRELUDED = ("acquire", "release", "account", "cancel", "claim", "sweep", "move", "index")
_PLAIN = ("account_keep", "heartbeat", "usage")
# Where a script wants the prelude's rest (routing/store/lua/prelude.lua); the prelude's functions
# a script's common case calls, named on its `-- @needs` line; where each begins.
REST = "-- @rest\n"
NEEDS = re.compile(r"^-- @needs (.*)$", re.M)
FN = re.compile(r"^-- @fn (\w+)\n", re.M)
# Redis 7 and later run a script that says so (`allow-oom`) at maxmemory too: then the free
# write a script makes first to be let through there (a line marked `-- @oom-guard`: a ZREM
# of nothing, one call) is left out. Redis 6.2 refuses the flag: the script as it is then.
ALLOW_OOM = "#!lua flags=allow-oom\n"
GUARD = "-- @oom-guard"
PROBE = ALLOW_OOM + "return 1"
_FLAGGED = ("acquire",)


def _lua(name: str) -> str:
    return resources.files("routing.store").joinpath("lua", name).read_text(encoding="utf-8")


class Prelude:
    """prelude.lua in its parts: the key names, the functions (`-- @fn name` blocks, in
    their order), and the rest."""

    def __init__(self, text: str) -> None:
        core, self.rest = text.split(REST)
        parts = FN.split(core)
        self.names = parts[0]
        self.functions = list(zip(parts[1::2], parts[2::2], strict=True))

    def around(self, body: str) -> str:
        """The key names, the functions the script's common case needs, its common case,
        the other functions and the prelude's rest at its `-- @rest` line (or at its start),
        then its other cases: Lua makes a local function on every call, so the common case
        makes only those it calls."""
        first, marked, then = body.partition(REST)
        found = NEEDS.search(first) if marked else None
        needs = set(found.group(1).split()) if found else set()
        if unknown := needs - {name for name, _ in self.functions}:
            raise ValueError(f"no such prelude function: {sorted(unknown)}")
        before = "".join(code for name, code in self.functions if name in needs)
        after = "".join(code for name, code in self.functions if name not in needs)
        if not marked:
            return self.names + after + self.rest + body
        return self.names + before + first + after + self.rest + then


def _unguarded(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if GUARD not in line)


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()  # noqa: S324


def _text_of(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def first_error(replies: Sequence[Any]) -> Exception | None:
    return next((r for r in replies if isinstance(r, Exception)), None)


class Scripts:
    def __init__(self) -> None:
        prelude = Prelude(_lua("prelude.lua"))
        self._text = {n: prelude.around(_lua(f"{n}.lua")) for n in _PRELUDED}
        self._text.update({n: _lua(f"{n}.lua") for n in _PLAIN})
        self._flagged = {n: ALLOW_OOM + _unguarded(self._text[n]) for n in _FLAGGED}
        self._plain = {n: _sha1(t) for n, t in self._text.items()}
        # What calls use: the flagged scripts' sha once Redis took them (`load`).
        self.sha = dict(self._plain)

    async def load(self, store: Store) -> None:
        texts = [*self._text.values(), *self._flagged.values(), PROBE]
        replies = await store.send([("SCRIPT", "LOAD", t) for t in texts])
        plain, flagged = replies[: len(self._text)], replies[len(self._text) :]
        for name, sha in zip(self._text, plain, strict=True):
            if isinstance(sha, Exception):
                raise sha
            if _text_of(sha) != self._plain[name]:
                raise RuntimeError(f"script {name}: Redis computed another sha1")
        took = all(not isinstance(r, Exception) for r in flagged) and await self._runs_flagged(
            store
        )
        for name, text in self._flagged.items():
            self.sha[name] = _sha1(text) if took else self._plain[name]

    @staticmethod
    async def _runs_flagged(store: Store) -> bool:
        """Whether a flagged script runs (a server that takes the text without knowing the
        flag, an emulation, fails it only then)."""
        (reply,) = await store.send([("EVALSHA", _sha1(PROBE), 0)])
        return not isinstance(reply, Exception) and int(reply) == 1

    def send(self, store: Store, calls: Sequence[Call]) -> asyncio.Future[list[Any]]:
        """Send the calls in one round trip, now; the future gets one reply per call (error
        replies in place). They are on their way even if whoever awaits is cancelled."""
        # The hot path: written in this tick by the lean client, no task per call.
        outer: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        sent = store.send(self._commands(calls))
        sent.add_done_callback(partial(self._settle, store, calls, outer))
        return outer

    async def call(self, store: Store, call: Call) -> Any:
        """One call; its error reply raised."""
        reply = (await self.send(store, [call]))[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _settle(
        self,
        store: Store,
        calls: Sequence[Call],
        outer: asyncio.Future[list[Any]],
        done: asyncio.Future[list[Any]],
    ) -> None:
        answered = not done.cancelled() and done.exception() is None
        if answered and any(isinstance(r, NoScriptError) for r in done.result()):
            retry = asyncio.ensure_future(self._resend_missing(store, calls, done.result()))
            retry.add_done_callback(partial(chain, outer))
        else:
            chain(outer, done)

    async def _resend_missing(
        self, store: Store, calls: Sequence[Call], replies: list[Any]
    ) -> list[Any]:
        """Redis lost its scripts (restart, failover, SCRIPT FLUSH): load them, then resend
        only the calls that did not run."""
        merged = list(replies)
        # Twice at most: a Cluster's call redirected to a master its slot map did not have
        # yet gets NOSCRIPT there, and the first load may leave before the map names it.
        for _ in range(2):
            missing = [i for i, r in enumerate(merged) if isinstance(r, NoScriptError)]
            if not missing:
                break
            try:
                await self.load(store)
                again = await store.send(self._commands([calls[i] for i in missing]))
            except NotSent as exc:
                if len(missing) == len(calls):
                    raise
                # The other calls ran (a Cluster: only one master lost its scripts): the
                # resend's failure is those calls' reply in place, so the caller gives back
                # what ran.
                again = [exc] * len(missing)
            for i, reply in zip(missing, again, strict=True):
                merged[i] = reply
        return merged

    def _commands(self, calls: Sequence[Call]) -> list[Command]:
        commands: list[Command] = []
        for name, keys, args in calls:
            sha = self.sha.get(name)
            if name == TRANSACTION:
                commands.append(Transaction(self._commands(args)))
            elif sha is None:
                commands.append((name, *keys, *args))  # tuples: hiredis packs them (wire.py)
            else:
                commands.append(("EVALSHA", sha, len(keys), *keys, *args))
        return commands
