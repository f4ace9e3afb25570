"""Log lines (gateway/edge/logs.py) and the access log middleware (gateway/edge/access.py), in
process.

The whole path through a real gateway process is in tests/e2e/test_logs.py."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from gateway.edge.access import NOTE, AccessLog, AccessNote
from gateway.edge.asgi import Message, Receive, Scope, Send
from gateway.edge.logs import ACCESS_LOGGER, JsonFormatter, TextFormatter


def scope(path: str = "/v1/chat/completions", method: str = "POST") -> Scope:
    return {"type": "http", "method": method, "path": path, "headers": []}


async def receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def discard(message: Message) -> None:
    pass


def answering(code: int, rid: str = "rid-1", **note: Any) -> Any:
    """An app answering `code` with `rid` in x-request-id, filling the note as a
    completion route would."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        found = scope.get(NOTE)
        if found is not None:
            for name, value in note.items():
                setattr(found, name, value)
        headers = [(b"x-request-id", rid.encode())]
        await send({"type": "http.response.start", "status": code, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


class Lines:
    """The access lines logged so far in this test."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self._caplog = caplog

    def __call__(self) -> list[logging.LogRecord]:
        return [r for r in self._caplog.records if r.name == ACCESS_LOGGER]


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> Iterator[Lines]:
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        yield Lines(caplog)


def fields(record: logging.LogRecord) -> dict[str, Any]:
    found: dict[str, Any] = record.fields  # type: ignore[attr-defined]
    return found


async def test_a_plain_request_is_one_line_with_the_answer_s_status_and_id(
    lines: Lines,
) -> None:
    await AccessLog(answering(404, "abc"))(scope("/nope", "GET"), receive, discard)
    [line] = lines()
    assert line.getMessage() == "GET /nope 404"
    got = fields(line)
    assert (got["request_id"], got["method"], got["path"], got["status"]) == (
        "abc",
        "GET",
        "/nope",
        404,
    )
    assert got["model"] is got["tier"] is got["queue_ms"] is got["ttft_ms"] is None
    assert got["duration_ms"] >= 0


async def test_what_the_route_noted_wins(lines: Lines) -> None:
    # A stream that started 200 and ended with an error event: the record says 502.
    note: dict[str, Any] = {
        "model": "m1",
        "tier": "flex",
        "status": 502,
        "queue_ms": 1.5,
        "ttft_ms": 20.0,
    }
    await AccessLog(answering(200, **note))(scope(), receive, discard)
    got = fields(lines()[0])
    assert {k: got[k] for k in note} == note


async def test_no_answer_at_all_is_499_and_a_crash_is_500(
    lines: Lines,
) -> None:
    async def silent(scope: Scope, receive: Receive, send: Send) -> None:
        pass

    async def crashing(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("boom")

    await AccessLog(silent)(scope(), receive, discard)
    with pytest.raises(RuntimeError):
        await AccessLog(crashing)(scope(), receive, discard)
    assert [fields(r)["status"] for r in lines()] == [499, 500]


async def test_lifespan_passes_through_without_a_line(lines: Lines) -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    await AccessLog(app)({"type": "lifespan"}, receive, discard)
    assert seen == ["lifespan"]
    assert lines() == []


async def test_a_path_cannot_forge_a_line(lines: Lines) -> None:
    await AccessLog(answering(404))(scope("/x\nfake INFO line\x1b[2J", "GET"), receive, discard)
    line = TextFormatter().format(lines()[0])
    assert "\n" not in line and "\x1b" not in line
    assert "/x\\nfake%20INFO%20line\\x1b[2J" in line


def record(msg: str, **extra: Any) -> logging.LogRecord:
    rec = logging.LogRecord("gateway.x", logging.WARNING, __file__, 1, msg, (), None)
    rec.__dict__.update(extra)
    return rec


def test_json_line_has_the_base_keys_then_the_fields() -> None:
    line = orjson.loads(JsonFormatter().format(record("hello", fields={"a": 1, "msg": "x"})))
    assert list(line)[:4] == ["ts", "level", "logger", "msg"]
    assert (line["level"], line["logger"], line["msg"], line["a"]) == (
        "WARNING",
        "gateway.x",
        "hello",
        1,
    )
    assert line["ts"].endswith("+00:00")


def test_json_line_of_an_exception_is_still_one_line() -> None:
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        rec = record("failed", exc_info=sys.exc_info())
    text = JsonFormatter().format(rec)
    assert "\n" not in text
    assert "ValueError" in orjson.loads(text)["exc"]


def test_text_line_leaves_out_what_the_message_says_and_unknowns() -> None:
    rec = record("GET / 200", fields={"path": "/", "model": None, "tier": "flex"})
    rec.in_message = ("path",)
    assert TextFormatter().format(rec).endswith("WARNING GET / 200 tier=flex")


def test_access_note_starts_empty() -> None:
    assert AccessNote() == AccessNote(None, None, None, None, None, None)


async def test_a_path_with_spaces_cannot_pose_as_fields(lines: Lines) -> None:
    path = "/v1/models/x 200 request_id=forged"
    await AccessLog(answering(405))(scope(path, "POST"), receive, discard)
    line = TextFormatter().format(lines()[0])
    assert "/v1/models/x%20200%20request_id=forged 405" in line


def test_a_text_field_with_spaces_or_equals_is_one_quoted_token() -> None:
    forged = "x model=demo tier=priority status=200"
    rec = record("POST / 404", fields={"request_id": forged, "model": 'a"b', "tier": "flex"})
    line = TextFormatter().format(rec)
    assert line.endswith(
        'POST / 404 request_id="x model=demo tier=priority status=200" model="a\\"b" tier=flex'
    )
