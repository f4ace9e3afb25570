"""Usage records on their way to the Redis stream `usage`, and a spool for when Redis is away.

A record rides in the same round trip as its lease's release (`record_call`), and
`usage.lua` appends it only once per request id, so resending is always safe. A record that
cannot reach Redis goes to a bounded JSON-lines file and is flushed by the keeper's sweep
once Redis answers again; a full spool is logged and counted, never dropped in silence.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import orjson
from pydantic import BaseModel, ConfigDict, Field

from routing.scripts import Call

log = logging.getLogger("gateway.usage")

USAGE_STREAM = "usage"
# How long a request id is remembered against duplicates (longer than any spool outage).
REMEMBER_S = 7 * 24 * 3600
FLUSH_BATCH = 500


class UsageSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Where records wait while Redis is away: one file per process, in this directory.
    spool_dir: str = Field(
        default_factory=lambda: os.environ.get("TMPDIR", "/tmp")  # noqa: S108 - per-pod scratch
    )
    spool_max_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    # The stream `usage` keeps this long (XTRIM MINID); request-id dedupe keys as long.
    retention_days: float = Field(35.0, gt=0.0, le=3650.0)


def record_call(fields: Mapping[str, str]) -> Call:
    """The script call appending `fields` once. Its identity is the request id, plus the
    admission attempt when known: callers may reuse an x-request-id, and two requests are
    still two records."""
    flat: list[str] = []
    for key, value in fields.items():
        flat += [key, value]
    dedupe = "{usage}:rid:" + fields["request_id"]
    if fields.get("attempt"):
        dedupe += ":" + fields["attempt"]
    return ("usage", [USAGE_STREAM, dedupe], [REMEMBER_S, *flat])


class UsageSpool:
    """Records Redis did not take yet, one JSON object per line, bounded in size."""

    def __init__(self, settings: UsageSettings) -> None:
        self.path = Path(settings.spool_dir) / "gateway-usage-spool.jsonl"
        self.max_bytes = settings.spool_max_bytes
        self.lost = 0  # records refused because the spool was full (logged each time)

    def add(self, fields: Mapping[str, str]) -> bool:
        line = orjson.dumps(dict(fields)) + b"\n"
        try:
            size = self.path.stat().st_size if self.path.exists() else 0
            if size + len(line) > self.max_bytes:
                self.lost += 1
                log.error(
                    "usage spool full (%d bytes): record %s lost", size, fields.get("request_id")
                )
                return False
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab") as out:
                out.write(line)
        except OSError as exc:
            self.lost += 1
            log.error("usage spool unwritable (%s): record %s lost", exc, fields.get("request_id"))
            return False
        return True

    def pending(self) -> bool:
        return self.path.exists() and self.path.stat().st_size > 0

    def take(self) -> tuple[list[dict[str, str]], int]:
        """The spooled records and how many bytes they span (for `done`)."""
        data = self.path.read_bytes()
        records = [orjson.loads(line) for line in data.splitlines() if line.strip()]
        return records, len(data)

    def done(self, flushed_bytes: int) -> None:
        """Drop the first `flushed_bytes` (those sent), keeping what was added meanwhile."""
        rest = self.path.read_bytes()[flushed_bytes:]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(rest)
        tmp.replace(self.path)
