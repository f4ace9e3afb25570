"""`gateway usage export`: the command around gateway/cli/exporter.py (arguments, output,
exit status)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import signal
import sys
from typing import TextIO

from redis.exceptions import RedisError

from gateway.runtime.settings import load_config
from routing.store.causes import cause_of


def usage_export(args: argparse.Namespace) -> int:
    from gateway.cli.exporter import export
    from routing.store.connect import connect

    config = load_config(args.config)
    by = [g.strip() for g in args.by.split(",") if g.strip()] if args.by else None
    if (problem := _export_problem(args.since, by, config.redis.url)) is not None:
        print(f"gateway usage export: {problem}", file=sys.stderr)
        return 2
    out = _Output(sys.stdout)

    async def run() -> int:
        redis = connect(config.redis.url, command_timeout_s=config.redis.command_timeout_s)
        try:
            return await export(redis, args.since, args.format, by, out)
        finally:
            await redis.aclose()

    try:
        rows = asyncio.run(run())
        out.flush()  # within the try: a reader gone shows here for a short export
    except BrokenPipeError:
        return _reader_gone()
    except _OutputFailed as exc:  # a full disk, say: not the store's fault
        print(f"gateway usage export: cannot write the output: {exc}", file=sys.stderr)
        return 1
    except (RedisError, OSError) as exc:
        print(f"gateway usage export: {cause_of(exc).text}", file=sys.stderr)
        return 1
    print(f"# {rows} rows", file=sys.stderr)
    return 0


def _export_problem(since: str | None, by: list[str] | None, store_url: str) -> str | None:
    """Why the export's arguments cannot work (said before any connection), or None."""
    from gateway.cli.exporter import GROUPS, since_id

    unknown = [g for g in by or [] if g not in GROUPS]
    if unknown:
        return f"--by: unknown group {unknown[0]!r}"
    if store_url.startswith("memory://"):
        return "a memory:// store lives inside its gateway"
    try:
        since_id(since)
    except ValueError as exc:
        return f"--since: {exc}"
    return None


class _OutputFailed(Exception):
    """Writing the export failed (other than a reader gone): said as such, not as a store
    error."""


class _Output(io.TextIOBase):
    """stdout for the export: UTF-8 whatever the locale (records hold any text), and a write
    error told apart from a store error."""

    def __init__(self, stream: TextIO) -> None:
        self._bytes = stream.buffer if hasattr(stream, "buffer") else None
        self._text = stream

    def write(self, text: str) -> int:
        try:
            if self._bytes is not None:
                self._bytes.write(text.encode())
            else:
                self._text.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputFailed(exc.strerror or str(exc)) from exc
        return len(text)

    def flush(self) -> None:
        try:
            (self._bytes or self._text).flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputFailed(exc.strerror or str(exc)) from exc


def _reader_gone() -> int:
    """stdout's reader left early (`| head`): no complaint, the exit status of a writer
    killed by SIGPIPE, as other Unix tools give."""
    # Python flushes stdout once more at exit, and would complain then.
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE
