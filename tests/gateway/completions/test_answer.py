"""Worker answers on the way back: SSE rewriting, usage pickup, worker error mapping."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from itertools import pairwise
from typing import Any, cast

import fakeredis
import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.app.front import build_app
from gateway.completions.answer import (
    DONE_EVENT,
    MAX_ERROR_MESSAGE,
    StreamRewriter,
    error_event,
    rewrite_answer,
    worker_error,
)
from gateway.completions.exchange import Usage
from gateway.completions.streamusage import StreamUsage, UsageForm
from gateway.errors import (
    RateLimited,
    UpstreamFailed,
    UpstreamTimeout,
    WorkerRejected,
)
from gateway.runtime.settings import parse_config
from gateway.runtime.state import GatewayState
from tests.redis_server import StreamEntries
from tiers.usage import UsageRecord

MODEL = "org/served"
USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}


def chunk(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "chat.completion.chunk",
        "model": "worker-name",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
        **extra,
    }


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def worker_stream() -> bytes:
    return b"".join(
        [
            b": keep-alive\n\n",
            sse(chunk("Hello")),
            sse(chunk(" world", usage=USAGE)),
            sse({**chunk(""), "choices": [], "usage": USAGE}),
            b"data: [DONE]\n\n",
        ]
    )


OPENAI = StreamUsage(UsageForm.CHUNK)
FORMS = [StreamUsage(form, continuous) for form in UsageForm for continuous in (False, True)]


def rewriter(wanted: StreamUsage = OPENAI, tier: str = "flex") -> StreamRewriter:
    return StreamRewriter(MODEL, tier, wanted, Usage())


def events(out: bytes) -> list[bytes]:
    assert out.endswith(b"\n\n") or out == b""
    return [e for e in out.split(b"\n\n") if e]


def payloads(out: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(e[len(b"data: ") :]) for e in events(out) if e.startswith(b"data: {")]


def feed_all(rw: StreamRewriter, parts: list[bytes]) -> bytes:
    return b"".join(rw.feed(p) for p in parts)


# --- StreamRewriter ---------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(data=st.data(), crlf=st.booleans(), wanted=st.sampled_from(FORMS))
def test_any_chunking_gives_the_same_output(
    data: st.DataObject, crlf: bool, wanted: StreamUsage
) -> None:
    stream = worker_stream()
    if crlf:
        stream = stream.replace(b"\n", b"\r\n")
    cuts = sorted(
        data.draw(st.sets(st.integers(min_value=1, max_value=len(stream) - 1), max_size=20))
    )
    bounds = [0, *cuts, len(stream)]
    parts = [stream[a:b] for a, b in pairwise(bounds)]

    whole = rewriter(wanted)
    expected = whole.feed(stream)
    split = rewriter(wanted)
    assert feed_all(split, parts) == expected
    assert split.done and whole.done
    assert split.usage == whole.usage
    assert split.usage.reported


def test_one_byte_at_a_time() -> None:
    stream = worker_stream()
    rw = rewriter()
    out = feed_all(rw, [stream[i : i + 1] for i in range(len(stream))])
    assert out == rewriter().feed(stream)
    assert len(events(out)) == 5


def test_model_and_tier_rewritten_in_every_data_event() -> None:
    out = rewriter(tier="priority").feed(worker_stream())
    bodies = payloads(out)
    assert len(bodies) == 3
    for body in bodies:
        assert body["model"] == MODEL
        assert body["service_tier"] == "priority"


def test_other_fields_pass_through() -> None:
    out = rewriter().feed(sse(chunk("Hi", system_fingerprint="fp", extra={"x": [1, 2]})))
    (body,) = payloads(out)
    assert body["system_fingerprint"] == "fp"
    assert body["extra"] == {"x": [1, 2]}
    assert body["choices"][0]["delta"]["content"] == "Hi"
    assert body["id"] == "cmpl-1"


def test_done_sets_done_and_is_relayed() -> None:
    rw = rewriter()
    assert rw.feed(sse(chunk("a"))) != b""
    assert not rw.done
    assert rw.feed(b"data: [DONE]\n\n") == DONE_EVENT
    assert rw.done


def test_done_without_space() -> None:
    rw = rewriter()
    assert rw.feed(b"data:[DONE]\n\n") == DONE_EVENT
    assert rw.done


def test_comments_pass_through_untouched() -> None:
    assert rewriter().feed(b": ping\n\n") == b": ping\n\n"
    assert rewriter().feed(b"event: message\n\n") == b"event: message\n\n"


def test_partial_event_held_back() -> None:
    rw = rewriter()
    event = sse(chunk("x"))
    assert rw.feed(event[:-1]) == b""
    assert rw.feed(event[-1:]) != b""


def test_non_json_data_passes_through() -> None:
    assert rewriter().feed(b"data: hello\n\n") == b"data: hello\n\n"
    assert rewriter().feed(b"data: [1, 2]\n\n") == b"data: [1, 2]\n\n"


def test_usage_taken_from_chunks() -> None:
    rw = rewriter()
    rw.feed(worker_stream())
    assert rw.usage.reported
    assert (rw.usage.prompt_tokens, rw.usage.completion_tokens) == (11, 3)


def test_no_usage_means_not_reported() -> None:
    rw = rewriter()
    rw.feed(sse(chunk("a")) + DONE_EVENT)
    assert not rw.usage.reported
    assert rw.usage.streamed == 1  # what a record counts when the worker never says


def test_usage_chunk_kept_when_include_usage() -> None:
    out = rewriter(OPENAI).feed(worker_stream())
    bodies = payloads(out)
    assert bodies[-1]["choices"] == []
    assert bodies[-1]["usage"] == USAGE
    assert bodies[1]["usage"] is None  # on the chunks before the last only when continuous


def test_continuous_usage_kept_on_every_chunk() -> None:
    out = rewriter(StreamUsage(UsageForm.CHUNK, continuous=True)).feed(worker_stream())
    bodies = payloads(out)
    assert bodies[1]["usage"] == USAGE and bodies[-1]["usage"] == USAGE


def test_usage_only_chunk_dropped_and_usage_removed_without_include_usage() -> None:
    rw = rewriter(StreamUsage(UsageForm.NONE))
    out = rw.feed(worker_stream())
    bodies = payloads(out)
    assert len(bodies) == 2
    assert all("usage" not in b for b in bodies)
    assert [b["choices"][0]["delta"]["content"] for b in bodies] == ["Hello", " world"]
    assert out.endswith(DONE_EVENT)
    assert rw.usage.reported  # billing still gets it
    assert rw.usage.prompt_tokens == 11


def test_crlf_line_endings() -> None:
    stream = worker_stream()
    rw = rewriter()
    out = rw.feed(stream.replace(b"\n", b"\r\n"))
    assert out == rewriter().feed(stream)
    assert b"\r" not in out
    assert rw.done


def test_crlf_split_between_cr_and_lf() -> None:
    event = sse(chunk("x")).replace(b"\n", b"\r\n")
    rw = rewriter()
    out = rw.feed(event[:-1]) + rw.feed(event[-1:])
    assert len(payloads(out)) == 1


def test_worker_error_event_becomes_envelope() -> None:
    rw = rewriter()
    rw.feed(sse(chunk("a")))
    out = rw.feed(sse({"error": {"message": "engine died", "type": "InternalServerError"}}))
    (body,) = payloads(out)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "engine died" in body["error"]["message"]
    assert isinstance(rw.error, UpstreamFailed)
    assert out == error_event(rw.error)
    assert not rw.done


def test_vllm_object_error_event_becomes_envelope() -> None:
    rw = rewriter()
    out = rw.feed(sse({"object": "error", "message": "boom", "type": "X", "code": 500}))
    (body,) = payloads(out)
    assert "boom" in body["error"]["message"]
    assert body["error"]["type"] == "api_error"
    assert rw.error is not None


def test_error_event_shape() -> None:
    out = error_event(UpstreamFailed("broken"))
    assert out.startswith(b"data: ")
    assert out.endswith(b"\n\n")
    assert orjson.loads(out[6:]) == {
        "error": {"message": "broken", "type": "api_error", "param": None, "code": "upstream_error"}
    }


# --- bounded events (limits.max_event_bytes) -------------------------------------------------

LIMIT = 1024


def bounded(limit: int = LIMIT) -> StreamRewriter:
    return StreamRewriter(MODEL, "default", OPENAI, Usage(), max_event_bytes=limit)


def sized_event(size: int) -> bytes:
    """One `data:` token event of exactly `size` bytes, its blank-line delimiter not counted."""
    event = sse(chunk("x" * (size - len(sse(chunk(""))) + 2)))[:-2]
    assert len(event) == size
    return event


def test_a_stream_without_delimiter_past_the_limit_ends_with_an_error_event() -> None:
    rw = bounded()
    assert len(payloads(rw.feed(sse(chunk("a"))))) == 1
    out = rw.feed(b"data: {")
    fed = 0
    while out == b"":
        out = rw.feed(b"x" * 100)
        fed += 100
        assert rw.buffered <= LIMIT + 2 and fed < 2 * LIMIT
    assert out == error_event(
        UpstreamFailed(f"The worker sent an SSE event larger than {LIMIT} bytes.")
    )
    assert isinstance(rw.error, UpstreamFailed) and rw.error.status == 502
    assert rw.buffered == 0  # the partial event is dropped, not kept
    assert rw.feed(b"x" * 100 + b"\n\n" + sse(chunk("b"))) == b""  # nothing after the cut
    assert rw.buffered == 0
    assert rw.usage.streamed == 1 and not rw.done


@pytest.mark.parametrize("crlf", [False, True])
def test_an_event_exactly_at_the_limit_passes_however_it_is_split(crlf: bool) -> None:
    event = sized_event(LIMIT)
    stream = event + (b"\r\n\r\n" if crlf else b"\n\n") + b"data: [DONE]\n\n"
    for cut in range(LIMIT - 2, LIMIT + 5):  # partial events that end in their delimiter
        rw = bounded()
        out = rw.feed(stream[:cut]) + rw.feed(stream[cut:])
        assert rw.error is None, cut
        assert len(payloads(out)) == 1 and rw.done


def test_a_complete_event_over_the_limit_is_cut_after_what_came_before() -> None:
    rw = bounded()
    out = rw.feed(sse(chunk("a")) + sized_event(LIMIT + 1) + b"\n\n" + sse(chunk("b")))
    bodies = payloads(out)
    assert [b["choices"][0]["delta"]["content"] for b in bodies[:-1]] == ["a"]
    assert f"larger than {LIMIT} bytes" in bodies[-1]["error"]["message"]
    assert out.endswith(error_event(UpstreamFailed(bodies[-1]["error"]["message"])))
    assert rw.error is not None and rw.buffered == 0


def test_a_worker_error_before_the_oversized_event_is_the_only_error() -> None:
    rw = bounded()
    out = rw.feed(sse({"error": {"message": "engine died"}}) + sized_event(LIMIT + 1))
    assert len(payloads(out)) == 1
    assert "engine died" in payloads(out)[0]["error"]["message"]


class EndlessEventResponse:
    """A worker's stream: two tokens, then one event of 32 MB that never ends, in 64 KiB
    chunks. Counts what the gateway pulled from it."""

    status = 200
    headers: dict[str, str] = {}

    def __init__(self) -> None:
        self.pulled = 0
        self.closed = False

    async def read(self) -> bytes:
        raise AssertionError("a stream is not read whole")

    async def chunks(self) -> AsyncIterator[bytes]:
        head = sse(chunk("a")) + sse(chunk("b")) + b'data: {"choices": [{"text": "'
        self.pulled += len(head)
        yield head
        piece = b"x" * 65536
        for _ in range(32 * 16):
            self.pulled += len(piece)
            yield piece

    def close(self) -> None:
        self.closed = True


class EndlessUpstream:
    def __init__(self) -> None:
        self.response = EndlessEventResponse()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> EndlessEventResponse:
        return self.response


async def test_a_32_mb_partial_event_is_cut_after_about_the_limit() -> None:
    limit = 1024 * 1024
    config = f"""
redis: {{url: "memory://"}}
limits: {{max_event_bytes: {limit}}}
models: {{m1: {{endpoints: [{{url: "http://127.0.0.1:9", max_concurrency: 2}}]}}}}
keys: [{{sha256: "{hashlib.sha256(b"sk-relay").hexdigest()}", account: relay}}]
"""
    upstream = EndlessUpstream()
    state = GatewayState(
        parse_config(config, "relay.yaml"),
        redis=fakeredis.FakeAsyncRedis(),
        upstream=upstream,  # type: ignore[arg-type]
    )
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        response = await client.post(
            "/v1/completions",
            json={"model": "m1", "prompt": "x", "stream": True},
            headers={"authorization": "Bearer sk-relay", "x-request-id": "cut-1"},
        )
    await state.admission.drain()

    assert response.status_code == 200  # the 200 was out before the worker misbehaved
    bodies = payloads(response.content)
    assert [b["choices"][0]["delta"]["content"] for b in bodies[:-1]] == ["a", "b"]
    assert bodies[-1]["error"]["message"] == (
        f"The worker sent an SSE event larger than {limit} bytes."
    )
    assert b"[DONE]" not in response.content
    # Read until just past the limit, not the 32 MB; the worker's response is closed.
    assert upstream.response.pulled <= limit + 2 * 65536 + 200
    assert upstream.response.closed

    (entry,) = cast(StreamEntries, await state.redis.xrange("usage"))
    record = UsageRecord.from_fields({k.decode(): v.decode() for k, v in entry[1].items()})
    assert (record.request_id, record.status, record.outcome) == ("cut-1", 502, "error")
    assert (record.completion_tokens, record.estimated) == (2, True)  # what was streamed


# --- worker_error ---------------------------------------------------------------------------


def test_vllm_400_passes_through_with_message() -> None:
    body = b'{"object":"error","message":"m","type":"BadRequestError","code":400}'
    exc = worker_error(400, body)
    assert isinstance(exc, WorkerRejected)
    assert exc.status == 400
    assert exc.message == "m"
    assert exc.code == "invalid_request"
    assert exc.envelope()["error"]["type"] == "invalid_request_error"


def test_openai_envelope_4xx_keeps_code_and_param() -> None:
    body = orjson.dumps(
        {"error": {"message": "too long", "code": "context_length_exceeded", "param": "messages"}}
    )
    exc = worker_error(422, body)
    assert isinstance(exc, WorkerRejected)
    assert (exc.status, exc.message, exc.code, exc.param) == (
        422,
        "too long",
        "context_length_exceeded",
        "messages",
    )


def test_fastapi_detail_used_as_message() -> None:
    exc = worker_error(400, b'{"detail": "bad prompt"}')
    assert exc.message == "bad prompt"
    exc = worker_error(400, b'{"detail": [{"loc": ["body"], "msg": "x"}]}')
    assert orjson.loads(exc.message) == [{"loc": ["body"], "msg": "x"}]


@pytest.mark.parametrize("status", [401, 403, 404])
def test_worker_auth_and_not_found_are_502(status: int) -> None:
    exc = worker_error(status, b'{"message": "nope"}')
    assert type(exc) is UpstreamFailed
    assert exc.status == 502
    assert str(status) in exc.message
    assert "nope" in exc.message


@pytest.mark.parametrize("status", [408, 504])
def test_worker_timeouts_are_504(status: int) -> None:
    exc = worker_error(status, b"")
    assert isinstance(exc, UpstreamTimeout)
    assert exc.status == 504


def test_worker_429_is_rate_limited_with_retry_after() -> None:
    exc = worker_error(429, b'{"message": "busy"}')
    assert isinstance(exc, RateLimited)
    assert exc.status == 429
    assert exc.code == "model_busy"
    assert exc.type == "rate_limit_error"
    assert int(exc.headers["retry-after"]) >= 1


@pytest.mark.parametrize("status", [500, 502, 503])
def test_worker_5xx_is_502(status: int) -> None:
    exc = worker_error(status, b'{"object":"error","message":"oom","code":500}')
    assert type(exc) is UpstreamFailed
    assert exc.status == 502
    assert "oom" in exc.message


def test_non_json_body_becomes_message() -> None:
    exc = worker_error(400, b"  <html>Bad Gateway</html>\n")
    assert isinstance(exc, WorkerRejected)
    assert exc.message == "<html>Bad Gateway</html>"
    assert exc.code == "invalid_request"


def test_empty_and_invalid_utf8_bodies() -> None:
    assert worker_error(400, b"").message == "no details"
    assert "\ufffd" in worker_error(400, b"\xff\xfe oops").message


def test_long_messages_are_cut() -> None:
    exc = worker_error(400, b"x" * (MAX_ERROR_MESSAGE * 3))
    assert len(exc.message) == MAX_ERROR_MESSAGE
    exc = worker_error(400, orjson.dumps({"message": "y" * (MAX_ERROR_MESSAGE * 3)}))
    assert len(exc.message) == MAX_ERROR_MESSAGE


def test_json_non_object_body() -> None:
    assert worker_error(400, b'"just text"').message == "just text"


# --- rewrite_answer -------------------------------------------------------------------------


def test_rewrite_answer_sets_model_tier_and_reads_usage() -> None:
    usage = Usage()
    body = orjson.dumps(
        {"id": "c1", "model": "worker-name", "choices": [{"text": "hi"}], "usage": USAGE}
    )
    out = orjson.loads(rewrite_answer(body, MODEL, "default", usage))
    assert out["model"] == MODEL
    assert out["service_tier"] == "default"
    assert out["choices"] == [{"text": "hi"}]
    assert out["usage"] == USAGE
    assert usage == Usage(prompt_tokens=11, completion_tokens=3, reported=True)


def test_rewrite_answer_overrides_worker_service_tier() -> None:
    body = orjson.dumps({"model": "w", "service_tier": "priority"})
    assert orjson.loads(rewrite_answer(body, MODEL, "flex", Usage()))["service_tier"] == "flex"


def test_rewrite_answer_keeps_a_lone_surrogate_escape() -> None:
    """Valid JSON that orjson refuses (a lone surrogate escape) passes as it would in a
    stream, not as a 502; the escape reaches the caller as the worker wrote it."""
    body = (
        b'{"model": "m1", "choices": [{"text": "a\\ud800b"}], '
        b'"usage": {"prompt_tokens": 2, "completion_tokens": 3}}'
    )
    usage = Usage()
    out = rewrite_answer(body, MODEL, "flex", usage)
    assert b'"text":"a\\ud800b"' in out
    assert json.loads(out)["choices"][0]["text"] == "a\ud800b"
    assert json.loads(out)["model"] == MODEL and json.loads(out)["service_tier"] == "flex"
    assert (usage.prompt_tokens, usage.completion_tokens) == (2, 3)


def test_rewrite_answer_without_usage() -> None:
    usage = Usage()
    rewrite_answer(b'{"choices": []}', MODEL, "default", usage)
    assert not usage.reported


@pytest.mark.parametrize(
    "body",
    [b"not json", b"", b'{"a": ', b"[1, 2]", b"42", b'{"a": "\\ud800"', b'{"a": "\\ud800\xff"}'],
)
def test_rewrite_answer_rejects_garbage(body: bytes) -> None:
    with pytest.raises(UpstreamFailed) as info:
        rewrite_answer(body, MODEL, "default", Usage())
    assert info.value.status == 502


@pytest.mark.parametrize(
    "raw",
    [None, "x", {"prompt_tokens": 1}, {"prompt_tokens": "1", "completion_tokens": 2}],
)
def test_usage_ignores_incomplete_records(raw: Any) -> None:
    usage = Usage()
    usage.take(raw)
    assert usage == Usage()


# --- the splice fast path agrees with a full parse -------------------------------------------

_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    content=_TEXT,
    worker_model=st.text(alphabet="abcdefghij-/._:", min_size=1, max_size=12),
    spaced=st.booleans(),
    model_first=st.booleans(),
    wanted=st.sampled_from(FORMS),
)
def test_spliced_chunks_equal_parsed_chunks(
    content: str, worker_model: str, spaced: bool, model_first: bool, wanted: StreamUsage
) -> None:
    chunk: dict[str, object] = {"id": "c1", "object": "chat.completion.chunk", "created": 1}
    choices = [{"index": 0, "delta": {"content": content}, "finish_reason": None}]
    items = [("model", worker_model), ("choices", choices), ("usage", None)]
    if not model_first:
        items.reverse()
    chunk.update(items)
    raw = json.dumps(chunk, separators=(", ", ": ") if spaced else (",", ":")).encode()
    rewriter = StreamRewriter("gw/served", "flex", wanted, Usage())
    out = rewriter.feed(b"data: " + raw + b"\n\n")
    assert out.startswith(b"data: ") and out.endswith(b"\n\n")
    got = json.loads(out[6:-2])
    expected = {**chunk, "model": "gw/served", "service_tier": "flex"}
    if wanted.form is UsageForm.NONE:
        del expected["usage"]
    assert got == expected
