"""The files of usage spools (routing/ledger/spool.py): one set per process, named after the store.

- `gateway-usage-<store>-<pid>-<token>.jsonl`: the records, JSON lines appended only by the
  process that admitted their requests. `<store>` names the Redis they belong to (so that a
  gateway adopts only spools of its own store); the pid plus a random token tell processes
  apart, also in containers where every process is pid 1 after each restart.
- `...-<token>.lock` beside it: flocked by its process for its whole life. The lock file,
  not the data file, since the data file is rewritten as its records leave. A lock that can
  be taken means the process is gone and its spool may be adopted.
- `gateway-usage-<store>.bad`: lines that could not be read (a kill during an append, a
  full disk), moved aside from every spool of the store, bounded in size.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import parse_qsl, urlencode, urlsplit

import orjson

PREFIX = "gateway-usage-"
# A record is well under 2 KiB; a longer line is garbage and is not read whole.
MAX_LINE_BYTES = 64 * 1024
BAD_MAX_BYTES = 16 * 1024 * 1024
_CREDENTIALS = {"password", "username", "user"}


def store_identity(url: str) -> str:
    """A short name for the store `url` points at, without its credentials (a rotated
    password is still the same store). `memory://` lives inside one process: each process
    gets its own identity, so no other process ever adopts its spool."""
    parts = urlsplit(url.strip())
    if parts.scheme == "memory":
        return "mem" + secrets.token_hex(6)
    hosts = parts.netloc.rpartition("@")[2].lower()
    path = parts.path
    if parts.scheme in ("redis", "rediss") and path.strip("/") == "":
        path = "/0"  # the default database, however spelt
    query = [(k, v) for k, v in parse_qsl(parts.query) if k.lower() not in _CREDENTIALS]
    canonical = f"{parts.scheme}://{hosts}{path}?{urlencode(sorted(query))}"
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class SpoolPaths:
    """The files of one process's spool."""

    directory: Path
    stem: str

    @classmethod
    def for_process(cls, directory: Path, store: str) -> SpoolPaths:
        return cls(directory, f"{PREFIX}{store}-{os.getpid()}-{secrets.token_hex(4)}")

    @property
    def data(self) -> Path:
        return self.directory / f"{self.stem}.jsonl"

    @property
    def lock(self) -> Path:
        return self.directory / f"{self.stem}.lock"

    @property
    def tmp(self) -> Path:
        return self.directory / f"{self.stem}.tmp"


def bad_path(directory: Path, store: str) -> Path:
    return directory / f"{PREFIX}{store}.bad"


def claim(paths: SpoolPaths) -> int:
    """Create and lock this process's lock file; the descriptor stays open, and locked, for
    the process's life. It is locked before it gets its name, so an adopter can never find
    the lock of a live process free."""
    paths.directory.mkdir(parents=True, exist_ok=True)
    fresh = paths.directory / f"{paths.stem}.lock.new"
    fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(fresh, paths.lock)
    except OSError:
        os.close(fd)
        raise
    return fd


def try_lock(path: Path) -> int | None:
    """The lock of a spool whose process is gone, or None (alive, or adopted meanwhile).
    Never created here: a lock file only ever gets its name from `claim`."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        os.close(fd)
        raise
    return fd


def others(directory: Path, store: str, own: str) -> list[SpoolPaths]:
    """The spools of `store` other processes made (alive or gone: their lock tells)."""
    try:
        locks = sorted(directory.glob(f"{PREFIX}{store}-*.lock"))
    except OSError:
        return []
    stems = (p.name.removesuffix(".lock") for p in locks)
    return [SpoolPaths(directory, stem) for stem in stems if stem != own]


def remove(paths: SpoolPaths) -> None:
    """Delete an adopted spool, its lock last (the caller still holds it)."""
    for path in (paths.data, paths.tmp, paths.lock):
        path.unlink(missing_ok=True)


def size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def append(path: Path, line: bytes, max_bytes: int) -> bool:
    """Append one record line; False when the file would pass `max_bytes`. A line left
    torn by an earlier failed write is ended first, so it cannot swallow this one."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        if size + len(line) > max_bytes:
            return False
        if os.write(fd, line) != len(line):
            # The part written is a torn line: the next append ends it, a flush sets it aside.
            raise OSError("short write (disk full?)")
    finally:
        os.close(fd)
    return True


def read_lines(file: BinaryIO, end: int, count: int) -> list[bytes]:
    """Up to `count` lines from the file's position, stopping at offset `end`. A line longer
    than MAX_LINE_BYTES comes back cut there (the rest is skipped): it is no record."""
    lines: list[bytes] = []
    while len(lines) < count and file.tell() < end:
        line = file.readline(MAX_LINE_BYTES + 1)
        if not line:
            break
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (rest := file.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
        lines.append(line)
    return lines


def parse(line: bytes) -> dict[str, str] | None:
    """The record a spool line holds, or None if the line is not one (torn, garbled)."""
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("request_id"), str):
        return None
    if not all(isinstance(v, str) for v in value.values()):
        return None
    return value


def set_aside(path: Path, lines: Iterable[bytes]) -> None:
    """Append unreadable lines to the `.bad` file, while it stays under BAD_MAX_BYTES (the
    rest are only counted). One write per line on an O_APPEND descriptor: gateways sharing
    the directory never interleave within a line."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        size = os.fstat(fd).st_size
        for line in lines:
            ended = line if line.endswith(b"\n") else line + b"\n"
            if size + len(ended) > BAD_MAX_BYTES:
                return
            size += os.write(fd, ended)
    finally:
        os.close(fd)


def rewrite(paths: SpoolPaths, kept: list[bytes], offset: int) -> int:
    """Replace the data file by `kept` followed by what lies past `offset` (records added
    meanwhile, or not yet sent); its new size. Synchronous: no append can slip in."""
    with paths.data.open("rb") as source, paths.tmp.open("wb") as out:
        out.writelines(kept)
        source.seek(offset)
        shutil.copyfileobj(source, out)
        size = out.tell()
    os.replace(paths.tmp, paths.data)
    return size
