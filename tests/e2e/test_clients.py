"""Clients as users run them, unchanged, against a gateway process with simulated workers:
the official openai SDK (errors, legacy prompt lists, models.retrieve) and langchain-openai
(ChatOpenAI and the completions class OpenAI, invoke and stream each)."""

from __future__ import annotations

import functools
import operator

import openai
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI, OpenAI

from tests.e2e.conftest import KEY, KEY_LIMITED, SLASHED, Fleet, Sdk

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


def test_a_batch_of_prompts_is_one_prompt_per_request(fleet: Fleet, sdk: Sdk) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as info:
        sdk(fleet.base_url).completions.create(model="m1", prompt=["a", "b"], max_tokens=3)
    assert info.value.param == "prompt"
    assert "prompt: " in str(info.value) and "one prompt per request" in str(info.value)


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
