"""Where a stream's usage reaches the caller: the table of gateway/completions/streamusage.py,
for the ways real workers send it (vLLM: a chunk of its own after the finish; llama.cpp: on
the finish chunk), for several choices, and for a stream that breaks off."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.completions.answer import DONE_EVENT, StreamRewriter
from gateway.completions.exchange import Usage
from gateway.completions.streamusage import StreamUsage, UsageForm
from gateway.schemas.common import StreamOptions

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
SEEDS, OPENAI, NONE = (StreamUsage(f) for f in (UsageForm.FINISH, UsageForm.CHUNK, UsageForm.NONE))


def chunk(text: str, finish: str | None = None, index: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "id": "cmpl-9",
        "object": "text_completion",
        "created": 1,
        "model": "worker-name",
        "choices": [{"index": index, "text": text, "finish_reason": finish}],
        **extra,
    }


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def usage_chunk() -> dict[str, Any]:
    return {**chunk(""), "choices": [], "usage": USAGE}


def vllm_stream(n: int = 1) -> list[bytes]:
    """vLLM asked for usage: tokens, each choice's finish, then a chunk of the usage alone."""
    parts = [sse(chunk(f"a{i}", index=i)) for i in range(n)]
    parts += [sse(chunk("b", "length", index=i)) for i in range(n)]
    return [*parts, sse(usage_chunk()), DONE_EVENT]


def llama_stream() -> list[bytes]:
    """llama.cpp's completions: the usage on the finish chunk itself, no chunk apart."""
    return [sse(chunk("a")), sse(chunk("b", "stop", usage=USAGE)), DONE_EVENT]


def run(wanted: StreamUsage, parts: list[bytes]) -> tuple[list[dict[str, Any]], StreamRewriter]:
    rw = StreamRewriter("gw", "default", wanted, Usage())
    out = b"".join(rw.feed(p) for p in parts)
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == DONE_EVENT.strip()
    return [orjson.loads(e[6:]) for e in events[:-1]], rw


def with_usage(bodies: list[dict[str, Any]]) -> list[int]:
    return [i for i, b in enumerate(bodies) if b.get("usage") is not None]


@pytest.mark.parametrize("parts", [vllm_stream(), vllm_stream(n=3), llama_stream()])
def test_seeds_form_puts_usage_on_the_last_finish_chunk(parts: list[bytes]) -> None:
    bodies, rw = run(SEEDS, parts)
    assert all(b["choices"] for b in bodies)  # chunk.choices[0] never fails
    assert with_usage(bodies) == [len(bodies) - 1]
    assert bodies[-1]["usage"] == USAGE and bodies[-1]["choices"][0]["finish_reason"]
    assert rw.usage.reported and rw.usage.completion_tokens == 2


def test_seeds_form_keeps_every_choice_and_its_order() -> None:
    bodies, _ = run(SEEDS, vllm_stream(n=3))
    assert [(b["choices"][0]["index"], b["choices"][0]["text"]) for b in bodies] == [
        (0, "a0"), (1, "a1"), (2, "a2"), (0, "b"), (1, "b"), (2, "b"),
    ]  # fmt: skip


@pytest.mark.parametrize("parts", [vllm_stream(), llama_stream()])
def test_openai_form_ends_with_a_usage_chunk_of_its_own(parts: list[bytes]) -> None:
    bodies, _ = run(OPENAI, parts)
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"] == USAGE
    assert with_usage(bodies) == [len(bodies) - 1]
    assert bodies[-1]["model"] == "gw" and bodies[-1]["id"] == "cmpl-9"


@pytest.mark.parametrize("parts", [vllm_stream(), llama_stream()])
def test_no_usage_anywhere_when_refused(parts: list[bytes]) -> None:
    bodies, rw = run(NONE, parts)
    assert all("usage" not in b and b["choices"] for b in bodies)
    assert rw.usage.reported  # billing still has it


def test_continuous_usage_rides_every_chunk() -> None:
    parts = [sse(chunk("a", usage=USAGE)), sse(chunk("b", "stop", usage=USAGE))]
    for wanted in (StreamUsage(UsageForm.FINISH, True), StreamUsage(UsageForm.CHUNK, True)):
        bodies, _ = run(wanted, [*parts, sse(usage_chunk()), DONE_EVENT])
        assert with_usage(bodies) == list(range(len(bodies)))


def test_a_held_finish_goes_out_before_a_broken_stream_ends() -> None:
    rw = StreamRewriter("gw", "default", SEEDS, Usage())
    out = rw.feed(sse(chunk("a")) + sse(chunk("b", "stop")))
    assert b'"b"' not in out  # held: its usage may follow
    (held,) = [orjson.loads(e[6:]) for e in rw.end().split(b"\n\n") if e]
    assert held["choices"][0]["text"] == "b" and "usage" not in held
    assert rw.end() == b""


def test_a_worker_error_sends_the_held_finish_first() -> None:
    rw = StreamRewriter("gw", "default", SEEDS, Usage())
    rw.feed(sse(chunk("b", "stop")))
    out = rw.feed(sse({"error": {"message": "engine died"}}))
    first, second = (orjson.loads(e[6:]) for e in out.split(b"\n\n") if e)
    assert first["choices"][0]["text"] == "b" and "error" in second


def test_finish_without_any_usage_is_sent_at_done() -> None:
    bodies, rw = run(SEEDS, [sse(chunk("a", "stop")), DONE_EVENT])
    assert bodies[0]["choices"][0]["text"] == "a" and "usage" not in bodies[0]
    assert not rw.usage.reported


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (None, SEEDS),
        ({}, SEEDS),
        ({"continuous_usage_stats": True}, StreamUsage(UsageForm.FINISH, True)),
        ({"include_usage": True}, OPENAI),
        ({"include_usage": False}, NONE),
        ({"include_usage": False, "continuous_usage_stats": True}, NONE),
    ],
)
def test_what_the_request_asked(options: dict[str, Any] | None, expected: StreamUsage) -> None:
    parsed = None if options is None else StreamOptions.model_validate(options)
    assert StreamUsage.of(parsed) == expected
