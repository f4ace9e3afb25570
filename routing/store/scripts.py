"""The Lua scripts of admission, registered once and run in batches: as one library of
Redis Functions (FCALL) where Redis has them (7.0 and later), else by EVALSHA.

A batch is several calls sent in one round trip. Its replies come back one per call, with
a call's own error reply (a NOSCRIPT, an OOM refusal, a script error) as an exception
object in its place, so that whoever sent the batch can give back what the other calls
took. A lost connection or a missed deadline fails the whole batch instead. Batches go
through a `Store` (routing/store/base.py), whichever client carries it.

Not redis-py's `register_script`: its pipelines ask SCRIPT EXISTS before every execute, a
second round trip on the hot path. Here a NOSCRIPT reply, or a function Redis does not have
(Redis restarted empty), reloads the scripts and resends only the calls that got it: the
others already ran and must not run twice (a second `account` call would count the request
twice).

Why Functions: a script defines the prelude's functions (routing/store/lua/prelude_*.lua) anew
on every call, about 9 usec of Redis CPU for all of them, so that each script's common case
makes only the few it needs; a library makes them once, when it is loaded, and a call runs
only its own code. Redis 6.2, an emulation that refuses the library, or a user whose ACL
does not allow FUNCTION LOAD: the same code as scripts.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Sequence
from functools import partial
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError, RedisError, ResponseError

from routing.store import keys as layout
from routing.store.base import Store
from routing.store.futures import chain
from routing.store.resp import NotSent
from routing.store.wire import Command, Transaction
from tiers.policy import BY_RANK

# One script call: (script name, KEYS, ARGV); a name that is not a script is sent as a plain
# Redis command (e.g. ZREM) with KEYS and ARGV as its arguments; `TRANSACTION` with no KEYS
# and calls as ARGV runs those all or none (routing/store/wire.py `Transaction`), one reply.
Call = tuple[str, Sequence[str], Sequence[Any]]
TRANSACTION = "MULTI"

# What a failed call raises: Redis did not do it, or may not have (the outage answers).
STORE_ERRORS = (RedisError, OSError)

_PRELUDED = (
    "acquire", "release", "account", "cancel", "sweep", "move", "index", "start",
)  # fmt: skip
_PLAIN = ("account_keep", "heartbeat", "usage", "ratelimit", "ratelimit_settle")
# Where a script wants the prelude's rest (routing/store/lua/prelude_*.lua); the prelude's functions
# a script's common case calls, named on its `-- @needs` line; where each begins.
REST = "-- @rest\n"
# Where the prelude takes its key names from the table (routing/store/keys.py).
KEY_NAMES, KEYS = "-- @key-names\n", "    -- @keys\n"
# Where it takes the number of tiers from the tier table (tiers/policy.py).
TIERS = "-- @tiers\n"
NEEDS = re.compile(r"^-- @needs (.*)$", re.M)
FN = re.compile(r"^-- @fn (\w+)\n", re.M)
# Redis 7 and later run a script that says so (`allow-oom`) at maxmemory too: then the free
# write a script makes first to be let through there (a line marked `-- @oom-guard`: a ZREM
# of nothing, one call) is left out. Redis 6.2 refuses the flag: the script as it is then.
ALLOW_OOM = "#!lua flags=allow-oom\n"
GUARD = "-- @oom-guard"
PROBE = ALLOW_OOM + "return 1"
_FLAGGED = ("acquire",)
# The library's name carries a digest of its code: replicas of two releases (a rolling
# update) each call their own, side by side.
LIBRARY = "gw_"


def _lua(name: str) -> str:
    return resources.files("routing.store").joinpath("lua", name).read_text(encoding="utf-8")


# The prelude's files (routing/store/lua/prelude_<part>.lua), in the order they make one
# chunk: those whose functions a script's common case may call (`-- @fn` blocks), then the
# rest, made where a script says `-- @rest`.
PRELUDE_CORE = ("names", "seats")
PRELUDE_REST = ("queue", "fair", "liveness", "pump", "spec")


def prelude_text() -> str:
    """The prelude as one text, the rest after its `-- @rest` line."""
    core = "".join(_lua(f"prelude_{part}.lua") for part in PRELUDE_CORE)
    return core + REST + "".join(_lua(f"prelude_{part}.lua") for part in PRELUDE_REST)


class Prelude:
    """The prelude in its parts: the key names, the functions (`-- @fn name` blocks, in
    their order), and the rest."""

    def __init__(self, text: str) -> None:
        text = text.replace(KEY_NAMES, layout.lua_declarations())
        text = text.replace(KEYS, layout.lua_names())
        text = text.replace(TIERS, layout.lua_tiers(len(BY_RANK)))
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
        names = self.names + "bind(KEYS)\n"
        if not marked:
            return names + after + self.rest + body
        return names + before + first + after + self.rest + then

    def library(self, bodies: dict[str, str]) -> tuple[str, str]:
        """One library of Redis Functions holding every script, and its name: the prelude
        made once, each script a function that binds its keys and runs its own code. Each
        may run at maxmemory (`allow-oom`, as the scripts' first writes let them: prelude
        `expire`), so its `-- @oom-guard` line is left out."""
        code = [self.names, *(fn for _, fn in self.functions), self.rest]
        for name, body in bodies.items():
            own = _unguarded(body)
            code.append(f"local function run_{name}(KEYS, ARGV)\nbind(KEYS)\n{own}end\n")
        text = "".join(code)
        library = LIBRARY + _sha1(text)[:16]
        registered = [
            f"redis.register_function{{function_name='{library}_{name}', callback=run_{name}, "
            "flags={'allow-oom'}}\n"
            for name in bodies
        ]
        probe = (
            f"redis.register_function{{function_name='{library}_probe', "
            "callback=function() return 1 end, flags={'no-writes'}}\n"
        )
        return f"#!lua name={library}\n" + text + "".join(registered) + probe, library


def _unguarded(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if GUARD not in line)


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()  # noqa: S324


def _text_of(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def first_error(replies: Sequence[Any]) -> Exception | None:
    return next((r for r in replies if isinstance(r, Exception)), None)


def missing(reply: Any) -> bool:
    """Whether a call's reply says Redis does not have the script or function it named."""
    return isinstance(reply, NoScriptError) or (
        isinstance(reply, ResponseError) and "Function not found" in str(reply)
    )


class Scripts:
    def __init__(self, *, functions: bool = True) -> None:
        """`functions`: run the scripts as a library of Redis Functions where Redis has them
        (False: always by EVALSHA)."""
        prelude = Prelude(prelude_text())
        bodies = {n: _lua(f"{n}.lua") for n in _PRELUDED}
        self._text = {n: prelude.around(bodies[n]) for n in _PRELUDED}
        self._text.update({n: _lua(f"{n}.lua") for n in _PLAIN})
        self._flagged = {n: ALLOW_OOM + _unguarded(self._text[n]) for n in _FLAGGED}
        self._plain = {n: _sha1(t) for n, t in self._text.items()}
        # What calls use: the flagged scripts' sha once Redis took them (`load`).
        self.sha = dict(self._plain)
        self._library, self.library = prelude.library(bodies) if functions else ("", "")
        # The scripts called as functions once Redis took the library, and the sha of those
        # called by EVALSHA (`load`).
        self.functions: dict[str, str] = {}
        self.loaded: dict[str, str] = {}

    def sources(self) -> dict[str, str]:
        """Each script's text as EVALSHA runs it (its prelude around it), and the library's
        code under the name "library" (without its first line, the library's name)."""
        library = self._library.partition("\n")[2]
        return {**self._text, **({"library": library} if library else {})}

    async def load(self, store: Store) -> None:
        """Load what the calls will run: the library and the plain scripts where Redis takes
        the library, else every script (Redis keeps what it is given: the scripts' texts,
        each with the prelude, hold about 370 KB, the library about 60 KB)."""
        functions = bool(self._library) and await self._loads_library(store)
        names = list(_PLAIN) if functions else list(self._text)
        flagged = {} if functions else self._flagged
        texts = [*(self._text[n] for n in names), *flagged.values(), PROBE]
        replies = await store.send([("SCRIPT", "LOAD", t) for t in texts])
        for name, sha in zip(names, replies, strict=False):
            if isinstance(sha, Exception):
                raise sha
            if _text_of(sha) != self._plain[name]:
                raise RuntimeError(f"script {name}: Redis computed another sha1")
        rest = replies[len(names) :]
        took = all(not isinstance(r, Exception) for r in rest) and await self._runs_flagged(store)
        for name, text in flagged.items():
            self.sha[name] = _sha1(text) if took else self._plain[name]
        self.functions = {n: f"{self.library}_{n}" for n in _PRELUDED} if functions else {}
        self.loaded = {n: self.sha[n] for n in names}

    def called_as(self, name: str) -> str:
        """What a call of script `name` names: its function once Redis took the library,
        else its sha (the benchmarks tell the scripts apart by it)."""
        return self.functions.get(name) or self.sha[name]

    async def _loads_library(self, store: Store) -> bool:
        """Whether Redis took the library and runs it (or had it already). Refused (Redis
        6.2, an ACL without FUNCTION, an emulation without it): the scripts run by EVALSHA."""
        (loaded,) = await store.send([("FUNCTION", "LOAD", self._library)])
        if isinstance(loaded, Exception) and "already exists" not in str(loaded):
            return False
        (reply,) = await store.send([("FCALL", f"{self.library}_probe", 0)])
        return not isinstance(reply, Exception) and int(reply) == 1

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
        if answered and any(missing(r) for r in done.result()):
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
            lost = [i for i, r in enumerate(merged) if missing(r)]
            if not lost:
                break
            try:
                await self.load(store)
                again = await store.send(self._commands([calls[i] for i in lost]))
            except NotSent as exc:
                if len(lost) == len(calls):
                    raise
                # The other calls ran (a Cluster: only one master lost its scripts): the
                # resend's failure is those calls' reply in place, so the caller gives back
                # what ran.
                again = [exc] * len(lost)
            for i, reply in zip(lost, again, strict=True):
                merged[i] = reply
        return merged

    def _commands(self, calls: Sequence[Call]) -> list[Command]:
        commands: list[Command] = []
        for name, keys, args in calls:
            sha = self.sha.get(name)
            if name == TRANSACTION:
                commands.append(Transaction(self._commands(args)))
            elif (function := self.functions.get(name)) is not None:
                commands.append(("FCALL", function, len(keys), *keys, *args))
            elif sha is None:
                commands.append((name, *keys, *args))  # tuples: hiredis packs them (wire.py)
            else:
                commands.append(("EVALSHA", sha, len(keys), *keys, *args))
        return commands
