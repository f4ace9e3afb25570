"""The official openai SDK against a real gateway in front of real simulated workers."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import KEY_LIMITED, SLASHED, Fleet, Sdk


@pytest.fixture
def client(fleet: Fleet, sdk: Sdk) -> openai.OpenAI:
    return sdk(fleet.base_url)


def test_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="m1", prompt="one two three", max_tokens=5, extra_body={"service_tier": "priority"}
    )
    assert out.model == "m1"
    assert out.service_tier == "priority"  # type: ignore[attr-defined]
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 5)


def test_chat_completion(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hello there"}], service_tier="flex"
    )
    assert out.model == "m1"
    assert out.service_tier == "flex"
    assert out.choices[0].message.content
    assert out.usage is not None and out.usage.completion_tokens == 8


def test_streamed_completion(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="m1", prompt="a b", max_tokens=4, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(text.split()) == 4
    assert {c.model for c in chunks} == {"m1"}
    assert {getattr(c, "service_tier", None) for c in chunks} == {"default"}
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 4  # include_usage defaults to true


def test_streamed_chat_without_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="m1",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": False},
        service_tier="priority",
    )
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)
    assert {c.service_tier for c in chunks} == {"priority"}
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streamed_chat_alias_model(client: openai.OpenAI) -> None:
    """m2 is served by a worker that knows it as m1; the caller only ever sees m2."""
    chunks = list(
        client.chat.completions.create(
            model="m2", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert {c.model for c in chunks} == {"m2"}


def test_models_list_follows_the_key(fleet: Fleet, sdk: Sdk) -> None:
    full = sdk(fleet.base_url).models.list()
    assert {m.id for m in full.data} == {
        "m1",
        "m2",
        "slow",
        "budgeted",
        "embed",
        "misnamed",
        SLASHED,
    }
    limited = sdk(fleet.base_url, KEY_LIMITED).models.list()
    assert [m.id for m in limited.data] == ["m1"]


def test_model_outside_allow_list_is_404(fleet: Fleet, sdk: Sdk) -> None:
    limited = sdk(fleet.base_url, KEY_LIMITED)
    with pytest.raises(openai.NotFoundError) as err:
        limited.chat.completions.create(model="m2", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"


def test_stream_is_relayed_not_buffered(fleet: Fleet, sdk: Sdk) -> None:
    """The first chunk arrives while the worker is still generating (it has 30 tokens to go)."""
    client = sdk(fleet.base_url)
    stream = client.completions.create(model="slow", prompt="x", stream=True)
    first = next(iter(stream))
    assert first.choices[0].text
    assert _running(fleet) == 1.0
    stream.close()


def test_dropped_stream_aborts_the_worker_request(fleet: Fleet, sdk: Sdk) -> None:
    client = sdk(fleet.base_url)
    before = _aborted(fleet)
    stream = client.completions.create(model="slow", prompt="x", stream=True)
    next(iter(stream))
    stream.close()
    # The worker notices the closed connection on its own schedule: wait, bounded.
    for _ in range(100):
        if _aborted(fleet) > before:
            break
        httpx.get(fleet.slow.url + "/health", timeout=1)
    assert _aborted(fleet) == before + 1


def _metric(fleet: Fleet, name: str) -> float:
    text = httpx.get(fleet.slow.url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _running(fleet: Fleet) -> float:
    return _metric(fleet, "vllm:num_requests_running")


def _aborted(fleet: Fleet) -> float:
    return _metric(fleet, 'vllm:request_success_total{finished_reason="abort"')


def test_a_chat_message_carries_refusal_null_as_vllm_sends_it(client: openai.OpenAI) -> None:
    """OpenAI's schema requires `refusal` on an assistant message; vLLM sends it null, and
    so does the simulator the suite runs on, through the gateway untouched."""
    raw = client.chat.completions.with_raw_response.create(
        model="m1", messages=[{"role": "user", "content": "hi"}]
    )
    message = raw.http_response.json()["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None
    assert raw.parse().choices[0].message.refusal is None
