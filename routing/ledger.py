"""Usage records on their way to the Redis stream `usage`, and a spool for when Redis is away.

A record rides in the same round trip as its lease's release (`FirstSends`), and a resend
(`record_call`: `usage.lua`) appends it only if its identity was never recorded, so
resending is always safe. A record that
cannot reach Redis waits in this process's own spool file (routing/spoolfile.py), bounded
in size; a record that cannot be kept is logged and counted, never dropped in silence.

The keeper runs `UsageSpool.tend` every second: it sends this process's spooled records,
adopts the spools of gone processes of the same store, trims the stream to the retention
and reads its length and age for the metrics. Whatever a round meets (Redis away or
refusing, torn lines), records stay spooled until Redis takes them, and the next round runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import chain
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from pydantic import BaseModel, ConfigDict, Field

from routing import spoolfile
from routing.scripts import TRANSACTION, Call, Scripts
from routing.slots import text
from routing.spoolfile import SpoolPaths
from routing.store import Store

log = logging.getLogger("gateway.usage")

USAGE_STREAM = "usage"
FLUSH_BATCH = 500
DEFAULT_RETENTION_S = 35 * 86400.0
# Request ids are remembered against duplicates as long as the stream keeps records, but
# never longer than this: a resend comes from a spool, and no spool waits that long (the
# dedupe keys would otherwise cost a quarter of the stream's memory again).
DEDUPE_MAX_S = 7 * 86400
# Where identities are remembered: a set per second of the records' time (ts), which goes
# when its identities may be forgotten; and the key of each identity, as older releases
# wrote them (resends still look there).
DEDUPE = "{usage}:rids:"
OLD_DEDUPE = "{usage}:rid:"
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
    still two records. A record first sent by an older release left its own key
    (`{usage}:rid:<identity>`), looked at too."""
    bucket, member, forget_at, flat = _record_parts(fields, retention_s)
    return ("usage", [USAGE_STREAM, bucket, OLD_DEDUPE + member], [forget_at, member, *flat])


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
        bucket = f"{DEDUPE}{second}"
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
    return f"{DEDUPE}{second}", member, _forget_at(second, retention_s), flat


def _forget_at(second: int, retention_s: float) -> int:
    return max(second, int(time.time())) * 1000 + _remember_ms(retention_s)


def identity(fields: Mapping[str, str]) -> tuple[str, str]:
    """Where a record's identity is remembered (the set of its second), and the identity."""
    second, member = _identity(fields)
    return f"{DEDUPE}{second}", member


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


class Ledger:
    """The owner of this replica's usage spool (None: none is kept) and of the way to the
    store its records go to."""

    def __init__(self, spool: UsageSpool | None, send: Send) -> None:
        self.spool = spool
        self.send = send

    def record_lost(self, rid: str, why: str) -> None:
        """A request's usage record could not even be built: counted with the lost ones."""
        if self.spool is not None:
            self.spool.lose(rid[:128], why)

    async def flush(self) -> int:
        """Send spooled usage records now (the keeper's spool round also does)."""
        return await self.spool.flush(self.send) if self.spool is not None else 0


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
                    ("PEXPIREAT", [f"{DEDUPE}{s}"], [s * 1000 + remember_ms])
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


@dataclass
class _Pass:
    """One pass over a spool file: what was dealt with, and what of it must stay."""

    offset: int = 0  # bytes dealt with: sent, set aside, or held in `kept`
    kept: list[bytes] = field(default_factory=list)  # refused by Redis, or not sent yet
    dropped: int = 0  # lines leaving the file (sent or set aside)
    sent: int = 0


class UsageSpool:
    """Records Redis did not take yet: this process's own file, and the rounds sending
    them (and those of gone processes of the same store)."""

    def __init__(self, settings: UsageSettings, store_url: str) -> None:
        self.directory = Path(settings.spool_dir)
        self.store = spoolfile.store_identity(store_url)
        self.max_bytes = settings.spool_max_bytes
        self.retention_s = settings.retention_s
        self.lost = 0  # records that could not be kept (each logged)
        self.bad_lines = 0  # unreadable lines set aside
        self.stream: StreamStats | None = None  # as of the last round
        # Spooled by other processes of the store (gone ones await adoption): they share the
        # bound, so a pod restarting in a loop while Redis is away cannot fill its disk.
        self._others_bytes = 0
        self._paths: SpoolPaths | None = None
        self._lock_fd: int | None = None
        self._busy = asyncio.Lock()  # one pass at a time rewrites the files

    @property
    def paths(self) -> SpoolPaths:
        # Named on first use, by the process that writes it.
        if self._paths is None:
            self._paths = SpoolPaths.for_process(self.directory, self.store)
        return self._paths

    @property
    def path(self) -> Path:
        return self.paths.data

    def record(self, fields: Mapping[str, str]) -> Call:
        return record_call(fields, self.retention_s)

    def add(self, fields: Mapping[str, str]) -> bool:
        """Keep a record for later; False (logged, counted in `lost`) if it cannot be."""
        rid = str(fields.get("request_id", ""))[:128]
        try:
            line = orjson.dumps(dict(fields)) + b"\n"
        except orjson.JSONEncodeError:
            return self.lose(rid, "unencodable")
        try:
            if self._lock_fd is None:
                self._lock_fd = spoolfile.claim(self.paths)
            if spoolfile.append(self.paths.data, line, self.max_bytes - self._others_bytes):
                return True
        except OSError as exc:
            return self.lose(rid, f"unwritable ({exc})")
        return self.lose(rid, f"full ({self.max_bytes} bytes with those of gone processes)")

    def lose(self, rid: str, why: str) -> bool:
        """A record that could not be kept: counted (gateway_usage_records_lost_total) and
        logged."""
        self.lost += 1
        log.error("usage spool %s: record %s lost", why, rid)
        return False

    def size_bytes(self) -> int:
        return spoolfile.size_of(self.paths.data)

    def pending(self) -> bool:
        return self.size_bytes() > 0

    async def tend(self, send: Send) -> None:
        """One maintenance round: flush, adopt, trim. Each step is tried even if one before
        failed (an unreadable foreign file must not stop the trimming); the first error is
        raised at the end, for the round's caller to count."""
        failed: list[Exception] = []
        for step in (self.flush, self.adopt, self._measure):
            try:
                await step(send)
            except Exception as exc:  # raised below, once the other steps had their turn
                failed.append(exc)
        if failed:
            raise failed[0]

    async def _measure(self, send: Send) -> None:
        self.stream = await trim_stream(send, self.retention_s)

    async def flush(self, send: Send) -> int:
        """Send this process's spooled records; how many Redis took. Records it refused
        stay; a raised error (Redis away) is raised after keeping what was not sent."""
        async with self._busy:
            sent, _ = await self._send_file(self.paths, send)
        if sent:
            log.info("flushed %d spooled usage records", sent)
        return sent

    async def adopt(self, send: Send) -> int:
        """Send, then delete, the spools of this store's processes that are gone (their
        lock is free). The lock decides: two adopters never both send one file."""
        adopted = 0
        async with self._busy:
            try:
                for other in spoolfile.others(self.directory, self.store, self.paths.stem):
                    adopted += await self._adopt_one(other, send)
            finally:
                self._others_bytes = sum(
                    spoolfile.size_of(o.data)
                    for o in spoolfile.others(self.directory, self.store, self.paths.stem)
                )
        if adopted:
            log.info("sent %d usage records spooled by gone processes", adopted)
        return adopted

    async def _adopt_one(self, other: SpoolPaths, send: Send) -> int:
        fd = spoolfile.try_lock(other.lock)
        if fd is None:
            return 0
        try:
            sent, empty = await self._send_file(other, send)
            if empty:
                spoolfile.remove(other)
        finally:
            os.close(fd)
        return sent

    async def _send_file(self, paths: SpoolPaths, send: Send) -> tuple[int, bool]:
        """Send a spool file's records in batches; (records sent, whether it is now empty).
        Unreadable lines are set aside; whatever happens, the file keeps what Redis has not
        taken yet."""
        try:
            file = paths.data.open("rb")
        except FileNotFoundError:
            return 0, True
        done = _Pass()
        with file:
            end = os.fstat(file.fileno()).st_size
            try:
                while done.offset < end and await self._send_batch(file, end, send, done):
                    pass
            finally:
                size = self._settle(paths, done)
        return done.sent, size == 0

    async def _send_batch(self, file: BinaryIO, end: int, send: Send, done: _Pass) -> bool:
        """One batch; False when Redis refused some of it (the rest waits for next round)."""
        lines = spoolfile.read_lines(file, end, FLUSH_BATCH)
        records: list[tuple[bytes, dict[str, str]]] = []
        unreadable: list[bytes] = []
        for line in lines:
            fields = spoolfile.parse(line)
            if fields is not None:
                records.append((line, fields))
            elif line.strip():
                unreadable.append(line)
        self._set_aside(unreadable)
        done.kept += [line for line, _ in records]  # until Redis has them
        done.dropped += len(lines) - len(records)
        done.offset = file.tell() if lines else end
        if not records:
            return True
        replies = await send([self.record(fields) for _, fields in records])
        del done.kept[len(done.kept) - len(records) :]
        pairs = zip(records, replies, strict=True)
        refused = [line for (line, _), reply in pairs if isinstance(reply, BaseException)]
        done.kept += refused
        done.sent += len(records) - len(refused)
        done.dropped += len(records) - len(refused)
        return not refused

    def _settle(self, paths: SpoolPaths, done: _Pass) -> int:
        """Rewrite the file without the lines that left it; its size afterwards."""
        if not done.dropped:
            return spoolfile.size_of(paths.data)
        if not done.kept and done.offset >= spoolfile.size_of(paths.data):
            paths.data.write_bytes(b"")
            return 0
        return spoolfile.rewrite(paths, done.kept, done.offset)

    def _set_aside(self, lines: list[bytes]) -> None:
        if not lines:
            return
        self.bad_lines += len(lines)
        bad = spoolfile.bad_path(self.directory, self.store)
        try:
            spoolfile.set_aside(bad, lines)
        except OSError as exc:
            log.error("usage spool: could not keep unreadable lines in %s (%s)", bad, exc)
        log.warning("usage spool: %d unreadable lines set aside in %s", len(lines), bad)

    def close(self) -> None:
        """At shutdown, after the last release: an empty spool leaves no file behind. A
        spool still holding records keeps its lock until the process exits, then the next
        gateway of the store adopts it."""
        if self._lock_fd is None or self.pending():
            return
        self.paths.data.unlink(missing_ok=True)
        self.paths.lock.unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = None
