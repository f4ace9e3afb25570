"""The process's log lines: text for people or JSON for log pipelines, quiet by default.

At INFO only what an operator acts on: start, stop, endpoints in and out of rotation,
reloads, store trouble. Health probes log nothing (aiohttp's client logs no requests), and
one line per request (gateway.access) only with `--access-log`. Keys, prompts and
completions are never in a log line.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

ACCESS_LOGGER = "gateway.access"
FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# Under `serve --workers N`, whose line it is (the parent's or a worker's).
_TEXT_PID = "%(asctime)s [%(process)d] %(name)s %(levelname)s %(message)s"


class TextFormatter(logging.Formatter):
    """`time logger LEVEL message`, then a record's `fields` as key=value (but those it
    names in `in_message`, already said by the message)."""

    def __init__(self, with_pid: bool = False) -> None:
        super().__init__(_TEXT_PID if with_pid else _TEXT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields: dict[str, Any] | None = getattr(record, "fields", None)
        if fields:
            said: tuple[str, ...] = getattr(record, "in_message", ())
            line += "".join(
                f" {k}={_value(v)}" for k, v in fields.items() if v is not None and k not in said
            )
        return line


def _value(value: Any) -> str:
    """A field's value as one token: quoted (JSON string) when it holds a space, a quote or
    an `=`, so that a caller's request id or model name cannot pose as another field."""
    text = str(value)
    if text and not any(c.isspace() or c in '"=' for c in text):
        return text
    return orjson.dumps(text).decode()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (with `with_pid`, pid), then the
    record's `fields` (an exception's traceback as `exc`)."""

    def __init__(self, with_pid: bool = False) -> None:
        super().__init__()
        self._with_pid = with_pid

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self._with_pid:
            line["pid"] = record.process
        fields: dict[str, Any] | None = getattr(record, "fields", None)
        if fields:
            line.update((k, v) for k, v in fields.items() if k not in line)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            line["stack"] = record.stack_info
        return orjson.dumps(line, default=str).decode()


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `setup` installs (and replaces when called again)."""


def setup(fmt: str = "text", *, access_log: bool = False, with_pid: bool = False) -> None:
    """Send log lines to stderr in `fmt` (text | json); per-request lines if `access_log`;
    each line with its process id if `with_pid` (several processes share the stream)."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    handler = _Handler(sys.stderr)
    handler.setFormatter(JsonFormatter(with_pid) if fmt == "json" else TextFormatter(with_pid))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # Python's warnings as log lines (JSON too)
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO if access_log else logging.WARNING)
