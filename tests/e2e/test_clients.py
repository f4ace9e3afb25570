"""Clients as users run them, unchanged, against a gateway process with simulated workers:
the official openai SDK (errors, legacy prompt lists, models.retrieve) and langchain-openai
(ChatOpenAI and the completions class OpenAI, invoke and stream each), and LiteLLM's SDK
reading a stream's usage."""

from __future__ import annotations

import functools
import json
import operator
import subprocess
import sys
import uuid
from pathlib import Path

import openai
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI, OpenAI

from tests.conftest import REDIS_URL
from tests.e2e.conftest import KEY, KEY_LIMITED, SLASHED, Fleet, Sdk
from tests.e2e.records import wait_records

# --- the official SDK -------------------------------------------------------------------------


def test_a_422_names_the_field_and_the_bound_in_the_sdk_exception(fleet: Fleet, sdk: Sdk) -> None:
    client = sdk(fleet.base_url)
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "hi"}], temperature=2.5
        )
    # What the SDK prints, not only what it keeps aside: "Error code: 422 - temperature: ..."
    text = str(info.value)
    assert text.startswith("Error code: 422 - temperature: "), text
    assert "less than or equal to 2" in text
    assert (info.value.param, info.value.code) == ("temperature", "invalid_request")


def test_a_prompt_list_of_one_string_is_that_prompt(fleet: Fleet, sdk: Sdk) -> None:
    out = sdk(fleet.base_url).completions.create(model="m1", prompt=["one two three"], max_tokens=3)
    assert out.usage is not None
    # The worker counted three prompt words: it got the text, not a list.
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 3)


def test_a_batch_of_prompts_is_one_request_answered_as_openai_indexes_it(
    fleet: Fleet, sdk: Sdk
) -> None:
    """Two prompts, n=2: four choices, prompt by prompt (index = prompt * n + j), one usage
    covering all, one record reserving both prompts and the four answers; streamed alike."""
    client, rids = sdk(fleet.base_url), [f"batch-{uuid.uuid4().hex}" for _ in range(2)]
    prompts = ["one two", "three four five"]
    out = client.completions.create(
        model="budgeted", prompt=prompts, max_tokens=2, n=2,
        extra_headers={"x-request-id": rids[0]},
    )  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(len(c.text.split()) == 2 for c in out.choices)
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 8)
    chunks = list(
        client.completions.create(
            model="budgeted", prompt=prompts, max_tokens=2, n=2, stream=True,
            extra_headers={"x-request-id": rids[1]},
        )
    )  # fmt: skip
    texts: dict[int, str] = {}
    for chunk in chunks:
        texts[chunk.choices[0].index] = (
            texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
        )
    assert {i: t for i, t in texts.items()} == {c.index: c.text for c in out.choices}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    found = wait_records(REDIS_URL, rids)
    for rid in rids:
        (record,) = found[rid]
        assert (record["prompt_tokens"], record["completion_tokens"]) == ("5", "8")
        # The prompts' estimate (7 and 15 bytes: 2 + 4 tokens) and 2 tokens for each answer.
        assert record["reserved_tokens"] == str(2 + 4 + 4 * 2)


def test_langchain_completions_generate_sends_one_batch(fleet: Fleet) -> None:
    """LangChain's OpenAI.generate sends its prompts as one list."""
    llm = OpenAI(
        model="m1", base_url=fleet.base_url, api_key=KEY, max_retries=0, timeout=30, max_tokens=3
    )
    result = llm.generate(["one two", "three four five", "six"])
    assert [len(g[0].text.split()) for g in result.generations] == [3, 3, 3]
    assert result.llm_output is not None
    assert result.llm_output["token_usage"]["prompt_tokens"] == 6


@pytest.mark.parametrize("name", ["m1", SLASHED])
def test_models_retrieve(fleet: Fleet, sdk: Sdk, name: str) -> None:
    model = sdk(fleet.base_url).models.retrieve(name)
    assert (model.id, model.object, model.owned_by) == (name, "model", "gateway")


@pytest.mark.parametrize(("key", "name"), [(KEY, "no-such/model"), (KEY_LIMITED, SLASHED)])
def test_models_retrieve_unknown_or_not_allowed_is_404(
    fleet: Fleet, sdk: Sdk, key: str, name: str
) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        sdk(fleet.base_url, key).models.retrieve(name)
    assert info.value.code == "model_not_found"


def test_models_retrieve_with_a_wrong_key_is_401(fleet: Fleet, sdk: Sdk) -> None:
    with pytest.raises(openai.AuthenticationError):
        sdk(fleet.base_url, "sk-not-a-key").models.retrieve("m1")


# --- langchain-openai -------------------------------------------------------------------------


# Not closed after use: langchain-openai shares one cached HTTP client between instances.
@pytest.fixture
def chat(fleet: Fleet) -> ChatOpenAI:
    return ChatOpenAI(
        model="m1", base_url=fleet.base_url, api_key=KEY, max_retries=0, timeout=30,
        stream_usage=True,
    )  # fmt: skip


@pytest.fixture
def completions(fleet: Fleet) -> OpenAI:
    return OpenAI(
        model="m1", base_url=fleet.base_url, api_key=KEY, max_retries=0, timeout=30, max_tokens=5
    )


def test_langchain_chat_invoke(chat: ChatOpenAI) -> None:
    message = chat.invoke("hello there")
    assert isinstance(message.content, str) and message.content
    assert message.response_metadata["model_name"] == "m1"
    assert message.usage_metadata is not None
    assert message.usage_metadata["output_tokens"] == 8


def test_langchain_chat_stream(chat: ChatOpenAI) -> None:
    chunks = list(chat.stream("hello there"))
    assert len(chunks) > 1  # relayed chunk by chunk
    whole = functools.reduce(operator.add, chunks)
    assert isinstance(whole, AIMessageChunk)
    assert isinstance(whole.content, str) and len(whole.content.split()) == 8
    assert whole.usage_metadata is not None and whole.usage_metadata["output_tokens"] == 8


def test_langchain_chat_shows_why_a_request_is_invalid(fleet: Fleet) -> None:
    llm = ChatOpenAI(model="m1", base_url=fleet.base_url, api_key=KEY, max_retries=0, top_p=1.5)
    with pytest.raises(openai.UnprocessableEntityError, match="top_p: "):
        llm.invoke("hi")


def test_langchain_completions_invoke(completions: OpenAI) -> None:
    # OpenAI.invoke sends `prompt` as a list holding the one string.
    text = completions.invoke("one two three")
    assert len(text.split()) == 5


def test_langchain_completions_stream(completions: OpenAI) -> None:
    pieces = list(completions.stream("one two three"))
    assert len(pieces) > 1
    assert len("".join(pieces).split()) == 5


def test_langchain_chat_stream_reads_the_usage_without_stream_options(fleet: Fleet) -> None:
    """No stream_options sent: the usage rides the finish chunk, where LangChain finds it."""
    llm = ChatOpenAI(
        model="m1", base_url=fleet.base_url, api_key=KEY, max_retries=0, timeout=30,
        stream_usage=False,
    )  # fmt: skip
    whole = functools.reduce(operator.add, llm.stream("hello there"))
    assert isinstance(whole, AIMessageChunk)
    assert whole.usage_metadata is not None
    assert (whole.usage_metadata["input_tokens"], whole.usage_metadata["output_tokens"]) == (2, 8)


# --- LiteLLM ----------------------------------------------------------------------------------

# Words the worker counts one token each, and tiktoken (LiteLLM's own estimate) does not.
LONG_WORDS = "antidisestablishmentarianism floccinaucinihilipilification"


def test_litellm_reads_the_usage_of_a_stream(fleet: Fleet) -> None:
    script = Path(__file__).with_name("litellm_stream.py")
    rows = ["absent", '{"include_usage": true}']
    done = subprocess.run(
        [sys.executable, str(script), fleet.base_url, KEY, "m1", LONG_WORDS, *rows],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]  # it prints too
    found = {r["row"]: r for r in map(json.loads, lines)}
    worker = {"prompt_tokens": 2, "completion_tokens": 3}
    assert found["absent"]["built"] == worker  # the worker's count, not LiteLLM's estimate
    assert found['{"include_usage": true}']["last"] == worker
