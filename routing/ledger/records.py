"""Usage records on their way to the Redis stream `usage`.

A record rides in the same round trip as its lease's release (`FirstSends`), and a resend
(`record_call`: `usage.lua`) appends it only if its identity was never recorded, so
resending is always safe. A record that cannot reach Redis waits in this process's own spool
(routing/ledger/spool.py). The keeper trims the stream to the retention (`trim_stream`)."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import chain
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from routing.store.base import Store
from routing.store.keys import DEDUPE_PREFIX, USAGE_STREAM
from routing.store.scripts import TRANSACTION, Call, Scripts
from routing.store.wire import text

DEFAULT_RETENTION_S = 35 * 86400.0
# Request ids are remembered against duplicates as long as the stream keeps records, but
# never longer than this: a resend comes from a spool, and no spool waits that long (the
# dedupe keys would otherwise cost a quarter of the stream's memory again).
DEDUPE_MAX_S = 7 * 86400
# Sets whose expiry this process set lately (a record's second is nearly always the newest).
STAMPS_KEPT = 8

# Sends calls in one round trip; one reply per call, an error reply (e.g. OOM) as an
# exception in its place; raises when Redis cannot be reached.
Send = Callable[[Sequence[Call]], Awaitable[list[Any]]]


class UsageSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Where records wait while Redis is away: one file per process, in this directory.
    spool_dir: str = Field(
        default_factory=lambda: os.environ.get("TMPDIR", "/tmp")  # noqa: S108 - per-pod scratch
    )
    spool_max_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    # The stream `usage` keeps this long (XTRIM MINID); request-id dedupe keys as long.
    retention_days: float = Field(35.0, gt=0.0, le=3650.0)

    @property
    def retention_s(self) -> float:
        return self.retention_days * 86400


def record_call(fields: Mapping[str, str], retention_s: float) -> Call:
    """The script call appending `fields` unless they were appended before (a resend: the
    spool's, or the records a lost master took). Its identity is the request id, plus the
    admission attempt when known: callers may reuse an x-request-id, and two requests are
    still two records."""
    bucket, member, forget_at, flat = _record_parts(fields, retention_s)
    return ("usage", [USAGE_STREAM, bucket], [forget_at, member, *flat])


class FirstSends:
    """The first send of records never sent before (the release's: its attempt is the
    lease id): each identity joins its second's set and the entry is appended, all or none,
    in a transaction. The set's expiry is set by the first record of each second this
    process sends (Redis lost a set whose expiry was set, a restart or a failover, only
    with the connection: `forget`, and the record then resends through `record_call`,
    which sets it again). A set member costs Redis about a third of a key with its own
    expiry (docs/redis.md); a resend goes through `record_call`, which checks first."""

    def __init__(self) -> None:
        self._stamped: dict[str, None] = {}  # the latest sets given their expiry, oldest first

    def call(self, fields: Mapping[str, str], retention_s: float) -> Call:
        second, member = _identity(fields)
        bucket = f"{DEDUPE_PREFIX}{second}"
        commands: list[Call] = [("SADD", [bucket], [member])]
        if bucket not in self._stamped:
            commands.append(("PEXPIREAT", [bucket], [_forget_at(second, retention_s)]))
            self._stamped[bucket] = None
            if len(self._stamped) > STAMPS_KEPT:
                del self._stamped[next(iter(self._stamped))]
        commands.append(("XADD", [USAGE_STREAM], ["*", *chain.from_iterable(fields.items())]))
        return (TRANSACTION, [], commands)

    def forget(self) -> None:
        """A record did not reach Redis: its set's expiry is set again by the next one."""
        self._stamped.clear()


def _record_parts(fields: Mapping[str, str], retention_s: float) -> tuple[str, str, int, list[str]]:
    """The set of the record's second, its identity, when the set goes (ms since the
    epoch: the retention after the record's second, or after now for an older record, whose
    resends the set must still catch), and the fields flat."""
    flat = list(chain.from_iterable(fields.items()))
    second, member = _identity(fields)
    return f"{DEDUPE_PREFIX}{second}", member, _forget_at(second, retention_s), flat


def _forget_at(second: int, retention_s: float) -> int:
    return max(second, int(time.time())) * 1000 + _remember_ms(retention_s)


def identity(fields: Mapping[str, str]) -> tuple[str, str]:
    """Where a record's identity is remembered (the set of its second), and the identity."""
    second, member = _identity(fields)
    return f"{DEDUPE_PREFIX}{second}", member


def _identity(fields: Mapping[str, str]) -> tuple[int, str]:
    member = fields["request_id"]
    if fields.get("attempt"):
        member += ":" + fields["attempt"]
    return _second_of(fields.get("ts", "")), member


def _remember_ms(retention_s: float) -> int:
    """How long identities are remembered: the retention, at most `DEDUPE_MAX_S`."""
    return max(1, int(min(retention_s, DEDUPE_MAX_S) * 1000))


def _second_of(ts: str) -> int:
    """The whole second (since the epoch) of a record's time, ISO 8601; one the gateway did
    not write (never seen) counts as now. The last second read is remembered by its text
    (the date and time of day, in UTC): the records of one second are read once."""
    if ts.endswith("+00:00") and ts[:19] == _LAST_SECOND[0]:
        return int(_LAST_SECOND[1])
    try:
        when = datetime.fromisoformat(ts)
    except ValueError:
        return int(time.time())
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    second = int(when.timestamp())
    if when.utcoffset() == timedelta(0) and len(ts) > 19 and ts[19] in ".+":
        _LAST_SECOND[:] = ts[:19], second
    return second


_LAST_SECOND: list[str | int] = ["", 0]  # the text of the last second `_second_of` read, and it


def store_sender(scripts: Scripts, store: Store) -> Send:
    """A `Send` over the store admission uses (one reply per call, error replies in place;
    scripts Redis lost are reloaded and the calls that did not run resent)."""

    async def send(calls: Sequence[Call]) -> list[Any]:
        return await scripts.send(store, calls)

    return send


@dataclass(frozen=True, slots=True)
class StreamStats:
    """The stream `usage` as the last round saw it."""

    length: int
    oldest_age_s: float


async def trim_stream(send: Send, retention_s: float) -> StreamStats:
    """Drop entries older than the retention (whole stream nodes, `~`: cheap, so an idle
    fleet trims too), then read the length and the age of the oldest entry left. The time
    is Redis's, like the entry ids'. The identity sets of this second and the last one get
    their expiry once more (`FirstSends`: a set Redis lost and a record made anew since)."""
    (clock,) = _raising(await send([("TIME", [], [])]))
    now_ms = int(clock[0]) * 1000 + int(clock[1]) // 1000
    floor = max(0, now_ms - int(retention_s * 1000))
    remember_ms = _remember_ms(retention_s)
    second = int(time.time())  # the gateway's clock, which names the sets (a record's ts)
    _, length, first, *_ = _raising(
        await send(
            [
                ("XTRIM", [USAGE_STREAM], ["MINID", "~", floor]),
                ("XLEN", [USAGE_STREAM], []),
                ("XRANGE", [USAGE_STREAM], ["-", "+", "COUNT", 1]),
                *(
                    ("PEXPIREAT", [f"{DEDUPE_PREFIX}{s}"], [s * 1000 + remember_ms])
                    for s in (second - 1, second)
                ),
            ]
        )
    )
    oldest_ms = int(text(first[0][0]).partition("-")[0]) if first else now_ms
    return StreamStats(int(length), max(0.0, (now_ms - oldest_ms) / 1000))


def _raising(replies: list[Any]) -> list[Any]:
    error = next((r for r in replies if isinstance(r, BaseException)), None)
    if error is not None:
        raise error
    return replies
