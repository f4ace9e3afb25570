"""A spool for usage records when Redis is away, and the ledger that owns it.

A record that cannot reach Redis waits in this process's own spool file
(routing/ledger/spoolfile.py), bounded in size; a record that cannot be kept is logged and
counted, never dropped in silence.

The keeper runs `UsageSpool.tend` every second: it sends this process's spooled records,
adopts the spools of gone processes of the same store, trims the stream to the retention
and reads its length and age for the metrics. Whatever a round meets (Redis away or
refusing, torn lines), records stay spooled until Redis takes them, and the next round runs."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import orjson

from routing.ledger import spoolfile
from routing.ledger.recent import Recent
from routing.ledger.records import (
    Send,
    StreamStats,
    UsageSettings,
    record_call,
    trim_stream,
)
from routing.ledger.spoolfile import SpoolPaths
from routing.store.scripts import Call

log = logging.getLogger("gateway.usage")


FLUSH_BATCH = 500


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
        # The records Redis took lately, for a store that can move to another master: the
        # admission's (routing/ledger/recent.py), which the records sent from here join.
        self.recent: Recent | None = None

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
        refused: list[bytes] = []
        for (line, fields), reply in pairs:
            if isinstance(reply, BaseException):
                refused.append(line)
            elif self.recent is not None:
                self.recent.took(fields)
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
