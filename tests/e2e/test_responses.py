"""`/v1/responses` and `/v1/embeddings` through the official openai SDK: the same walk as
chat (auth, tier, admission with its token reservation, fallbacks, relay, one usage
record), for models whose config says their workers serve them; a clear 404 otherwise."""

from __future__ import annotations

import uuid
from typing import Any

import openai
import pytest

from tests.conftest import REDIS_URL
from tests.e2e.conftest import Fleet, Sdk
from tests.e2e.records import wait_records


def rid() -> dict[str, str]:
    return {"x-request-id": f"resp-{uuid.uuid4().hex}"}


def record_of(headers: dict[str, str]) -> dict[str, str]:
    key = headers["x-request-id"]
    (record,) = wait_records(REDIS_URL, [key])[key]
    return record


def test_a_response(fleet: Fleet, sdk: Sdk) -> None:
    headers = rid()
    out = sdk(fleet.base_url).responses.create(
        model="budgeted", input="one two three", max_output_tokens=4, service_tier="priority",
        extra_headers=headers,
    )  # fmt: skip
    assert (out.model, out.service_tier, out.status) == ("budgeted", "default", "incomplete")
    assert len(out.output_text.split()) == 4
    assert out.usage is not None
    usage = (out.usage.input_tokens, out.usage.output_tokens)
    record = record_of(headers)
    assert (int(record["prompt_tokens"]), int(record["completion_tokens"])) == usage
    assert record["tier"] == "default"  # budgeted lists no priority tier
    # Its input (13 bytes: 4 tokens) and the 4 tokens it may answer.
    assert record["reserved_tokens"] == "8"


def test_a_streamed_response(fleet: Fleet, sdk: Sdk) -> None:
    headers = rid()
    events = list(
        sdk(fleet.base_url).responses.create(
            model="m1", input=[{"role": "user", "content": "one two"}], max_output_tokens=3,
            stream=True, extra_headers=headers, service_tier="flex",
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 3
    final: Any = events[-1]
    assert (final.response.model, final.response.service_tier) == ("m1", "flex")
    assert final.response.usage.output_tokens == 3
    record = record_of(headers)
    assert (record["completion_tokens"], record["tier"], record["estimated"]) == ("3", "flex", "0")


def test_a_model_whose_workers_do_not_serve_it_is_skipped_or_404(fleet: Fleet, sdk: Sdk) -> None:
    client = sdk(fleet.base_url)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="m2", input="hi")
    assert "'m2'" in info.value.message and "responses" in info.value.message
    out = client.responses.create(model="m2", input="hi", extra_body={"models": ["m2", "m1"]})
    assert out.model == "m1"  # the fallback that serves it


def test_embeddings(fleet: Fleet, sdk: Sdk) -> None:
    headers = rid()
    client = sdk(fleet.base_url)
    out = client.embeddings.create(model="embed", input=["one two", "three"], extra_headers=headers)
    assert [d.index for d in out.data] == [0, 1]
    assert all(len(d.embedding) == 8 for d in out.data)
    assert out.model == "embed"
    assert (out.usage.prompt_tokens, out.usage.total_tokens) == (3, 3)
    record = record_of(headers)
    assert (record["prompt_tokens"], record["completion_tokens"]) == ("3", "0")
    assert record["reserved_tokens"] == "4"  # its input alone (7 and 5 bytes: 2 + 2 tokens)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="m1", input="x")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="embed", messages=[{"role": "user", "content": "x"}])
