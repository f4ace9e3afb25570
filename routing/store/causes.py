"""What a store (Redis) error means, said once a minute, not on every retry.

A failed store call is either an outage (Redis cannot be reached, stalls, or this process
has no free connection), which heals by itself and which `redis.on_outage` answers, or a
misconfiguration, which never heals by itself: a wrong or missing password, an ACL user
without a permission the gateway needs, a TLS certificate the client refuses, or a URL that
points at a Sentinel or a replica instead of a master, or a master name the sentinels do
not know. `cause_of` tells them apart and
names the cause in one line ("redis: WRONGPASS ..."), from redis-py's exception classes and
from Redis's own error codes (the RESP client keeps them in the message; redis-py strips
them). `StoreErrors` logs each cause at most once a minute with a count of the repeats, and
remembers a misconfiguration that refused a request, for /readyz.

Messages are Redis's or the client library's: they name commands and addresses, never
keys, prompts or passwords. They are cut to one short line all the same.
"""

from __future__ import annotations

import logging
import re
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    MaxConnectionsError,
    NoPermissionError,
    ReadOnlyError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from routing.store.sentinel import UnknownMaster

log = logging.getLogger("gateway.store")

# Kinds that never heal by themselves: `gateway serve` refuses to start on one of them.
MISCONFIGURED = frozenset({"auth", "permission", "tls", "not_master", "no_master"})
# Kinds whose messages vary (addresses, errno) but mean one thing: one log line for them all.
_BY_KIND = frozenset({"unreachable", "timeout", "pool"})
REPORT_EVERY_S = 60.0
# A misconfiguration that refused a request keeps /readyz at 503 this long after.
REFUSAL_MEMORY_S = 10.0
_MAX_LINE = 240


@dataclass(frozen=True, slots=True)
class Cause:
    kind: str  # a fixed word: auth, permission, tls, not_master, unreachable, timeout, ...
    text: str  # one line, "redis: ..."

    @property
    def misconfigured(self) -> bool:
        return self.kind in MISCONFIGURED

    @property
    def public(self) -> str:
        """The cause as /readyz tells anyone who asks: its kind and Redis's error code, with
        no address, user or topology (the full line goes to the log)."""
        if self.kind == "auth":
            code = "NOAUTH" if "NOAUTH" in self.text else "WRONGPASS"
            return f"redis: {code} (wrong or missing password)"
        if self.kind == "permission":
            command = re.search(r"'([A-Za-z|]{1,40})'", self.text)
            named = f": {command.group(1).lower()}" if command else ""
            return f"redis: NOPERM (missing ACL permission{named})"
        if self.kind == "not_master":
            what = "sentinel" if "sentinel" in self.text.lower() else "replica"
            return f"redis: not a master ({what})"
        if self.kind == "tls":
            return self.text if "verify failed" in self.text else "redis: TLS failed"
        if self.kind == "timeout" and self.text.startswith("redis: no answer within"):
            return self.text  # the gateway's own timeout, nothing of the store's
        return _PUBLIC.get(self.kind, "redis: error")

    @property
    def key(self) -> str:
        return self.kind if self.kind in _BY_KIND else f"{self.kind}:{self.text}"


_PUBLIC = {
    "unreachable": "redis: unreachable",
    "timeout": "redis: no answer in time",
    "pool": "redis: no free connection in this process",
    "no_master": "redis: the sentinels know no master of that name",
    "no_replicas": "redis: the master refuses writes (too few replicas)",
}


def _line(message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else ""
    return first if len(first) <= _MAX_LINE else first[: _MAX_LINE - 3] + "..."


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and what caused it (the RESP client wraps its connect errors)."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(seen) < 5:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def cause_of(exc: BaseException) -> Cause:
    """The one-line cause of a failed store call."""
    chain = _chain(exc)
    for link in chain:
        found = _by_class(link) or _by_message(_line(str(link)))
        if found is not None:
            return found
    if any(isinstance(e, (TimeoutError, RedisTimeoutError)) for e in chain):
        detail = _line(str(exc))
        return Cause("timeout", f"redis: no answer in time ({detail})" if detail else
                     "redis: no answer in time")  # fmt: skip
    message = _line(str(exc)) or type(exc).__name__
    if isinstance(exc, (RedisConnectionError, OSError)):
        return Cause("unreachable", f"redis: unreachable ({message})")
    return Cause("error", f"redis: {type(exc).__name__}: {message}")


def _by_class(exc: BaseException) -> Cause | None:
    message = _line(str(exc))
    if isinstance(exc, UnknownMaster):
        return Cause("no_master", f"redis: {message}")
    if isinstance(exc, MaxConnectionsError):
        return Cause("pool", f"redis: no free connection in this process's pool ({message})")
    if isinstance(exc, (AuthenticationError, AuthorizationError)):
        if "invalid username-password" in message:
            return Cause("auth", f"redis: WRONGPASS {message}")
        if message.lower().startswith("authentication required"):
            message = f"NOAUTH {message}"
        elif not message.startswith(("WRONGPASS", "NOAUTH")):
            message = f"NOAUTH authentication required ({message})"
        return Cause("auth", f"redis: {message}")
    if isinstance(exc, NoPermissionError):
        return Cause("permission", f"redis: NOPERM {message}")
    if isinstance(exc, ReadOnlyError):
        return Cause("not_master", f"redis: not a master (replica: READONLY {message})")
    if isinstance(exc, ssl.SSLError):
        return _tls(message)
    return None


def _by_message(message: str) -> Cause | None:
    code = message.split(" ", 1)[0]
    if code in ("WRONGPASS", "NOAUTH"):
        return Cause("auth", f"redis: {message}")
    if code == "NOPERM":
        return Cause("permission", f"redis: {message}")
    if "can't run this command" in message or "can't publish" in message:  # inside a script
        return Cause("permission", f"redis: NOPERM {message}")
    if code == "NOREPLICAS":  # min-replicas-to-write: the master lost its replicas (failover)
        return Cause("no_replicas", f"redis: {message}")
    if code == "READONLY" or "write against a read only replica" in message:
        return Cause("not_master", f"redis: not a master (replica: {message})")
    if "unknown command" in message and any(
        f"'{c}'" in message.upper() for c in ("EVALSHA", "EVAL", "SCRIPT", "HGET")
    ):
        command = message.split("'")[1] if "'" in message else "EVALSHA"
        return Cause("not_master", f"redis: not a master (it refuses {command}: a Sentinel?)")
    if "No connection available" in message:  # redis-py's blocking pool waited in vain
        return Cause("pool", f"redis: no free connection in this process's pool ({message})")
    if "CERTIFICATE_VERIFY_FAILED" in message or "[SSL" in message:
        return _tls(message)
    return None


def _tls(message: str) -> Cause:
    if "certificate verify failed" in message:
        reason = message.split("certificate verify failed", 1)[1].lstrip(": ").split(" (_ssl")[0]
        detail = f": {reason}" if reason else ""
        return Cause("tls", f"redis: TLS certificate verify failed{detail}")
    return Cause("tls", f"redis: TLS failed ({message})")


@dataclass(slots=True)
class _Said:
    at: float
    repeats: int = 0
    where: set[str] = field(default_factory=set)


class StoreErrors:
    """Store errors of one process: each cause logged at most once per `every_s`, with how
    often it came back since; the last misconfiguration that refused a request."""

    def __init__(
        self, every_s: float = REPORT_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_s = every_s
        self._clock = clock
        self._said: OrderedDict[str, _Said] = OrderedDict()
        self._refusal: tuple[float, Cause] | None = None

    def report(self, exc: BaseException, where: str, *, refused: bool = False) -> Cause:
        """A store call made by `where` (a fixed word) failed; `refused`: a request got a
        503 for it."""
        return self.note(cause_of(exc), where, refused=refused)

    def note(self, cause: Cause, where: str, *, refused: bool = False) -> Cause:
        """`report`, for a cause found otherwise (a probe's reply)."""
        now = self._clock()
        if refused and cause.misconfigured:
            self._refusal = (now, cause)
        said = self._said.get(cause.key)
        if said is not None and now - said.at < self.every_s:
            said.repeats += 1
            said.where.add(where)
            return cause
        level = logging.ERROR if cause.misconfigured else logging.WARNING
        if said is not None and said.repeats:
            also = ", ".join(sorted(said.where))
            log.log(level, "%s (%s; %d more since the last report, from %s)",
                    cause.text, where, said.repeats, also)  # fmt: skip
        else:
            log.log(level, "%s (%s)", cause.text, where)
        self._said[cause.key] = _Said(now)
        self._said.move_to_end(cause.key)
        while len(self._said) > 64:  # causes are few; a bound all the same
            self._said.popitem(last=False)
        return cause

    def refusal(self) -> Cause | None:
        """A misconfiguration that refused a request lately, or None."""
        if self._refusal is None or self._clock() - self._refusal[0] > REFUSAL_MEMORY_S:
            return None
        return self._refusal[1]
