"""The simulated worker answers as vLLM does, field for field: its bodies, chunks and events
have the shape of real vLLM 0.32's answers to the same requests (tests/gateway/sim/vllm/, taken
from `vllm serve` on the CPU with the real-worker tests' tiny model). Values differ (the
text, ids, counts); every key, and the JSON type of every value, must not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.sim import SimOptions, build_sim_app

VLLM = Path(__file__).with_name("vllm")
CHAT = {"messages": [{"role": "user", "content": "one two"}]}
COMPLETION = {"prompt": "one two"}
STREAM_OPTIONS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "usage": {"include_usage": True},
    "continuous": {"include_usage": True, "continuous_usage_stats": True},
}


def shape(value: Any) -> Any:
    """Keys and JSON types, recursively (a list by its first element)."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return ["list", *([shape(value[0])] if value else [])]
    return "null" if value is None else type(value).__name__


async def sim_answer(path: str, body: dict[str, Any]) -> httpx.Response:
    app = build_sim_app(SimOptions(models=("tiny",), ttft_ms=0, itl_ms=0))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        return await client.post(path, json={"model": "tiny", **body})


def events(text: str) -> list[dict[str, Any]]:
    """The JSON of each SSE event, [DONE] left out."""
    found = []
    for block in text.split("\n\n"):
        data = [line[6:] for line in block.splitlines() if line.startswith("data: ")]
        if data and data[0] != "[DONE]":
            found.append(json.loads(data[0]))
    return found


def by_role(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's chunks by what they are: the role chunk, a token, the last token (which
    carries the finish), the usage chunk."""
    roles: dict[str, Any] = {}
    for chunk in chunks:
        choices = chunk["choices"]
        if not choices:
            role = "usage"
        elif "role" in choices[0].get("delta", {}):
            role = "role"
        else:
            role = "finish" if choices[0]["finish_reason"] else "token"
        roles.setdefault(role, shape(chunk))
    return roles


@pytest.mark.parametrize(("path", "name", "body"), [
    ("/v1/chat/completions", "chat", {**CHAT, "max_tokens": 3}),
    ("/v1/completions", "completions", {**COMPLETION, "max_tokens": 3}),
    ("/v1/responses", "responses", {"input": "one two", "max_output_tokens": 3}),
])  # fmt: skip
async def test_a_body_has_vllms_fields(path: str, name: str, body: dict[str, Any]) -> None:
    expected = json.loads((VLLM / f"{name}.json").read_text())
    assert shape((await sim_answer(path, body)).json()) == shape(expected)


@pytest.mark.parametrize("options", STREAM_OPTIONS)
@pytest.mark.parametrize(("path", "name", "body"), [
    ("/v1/chat/completions", "chat", CHAT), ("/v1/completions", "completions", COMPLETION),
])  # fmt: skip
async def test_a_streams_chunks_have_vllms_fields(
    path: str, name: str, body: dict[str, Any], options: str
) -> None:
    asked = STREAM_OPTIONS[options]
    extra = {} if asked is None else {"stream_options": asked}
    answer = await sim_answer(path, {**body, "max_tokens": 3, "stream": True, **extra})
    assert answer.text.endswith("data: [DONE]\n\n")
    expected = (VLLM / f"{name}-stream-{options}.sse").read_text()
    assert by_role(events(answer.text)) == by_role(events(expected))


async def test_a_responses_streams_events_have_vllms_fields() -> None:
    body = {"input": "one two", "max_output_tokens": 3, "stream": True}
    got = events((await sim_answer("/v1/responses", body)).text)
    expected = events((VLLM / "responses-stream.sse").read_text())
    assert [e["type"] for e in got] == [e["type"] for e in expected]
    assert [e["sequence_number"] for e in got] == list(range(len(expected)))
    assert {e["type"]: shape(e) for e in got} == {e["type"]: shape(e) for e in expected}
