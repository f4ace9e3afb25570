"""Where a stream's usage reaches the caller, through the official openai SDK, for each row
of docs/api.md's table: the tutorial loop (`chunk.choices[0].delta`, `.text`) runs to the
end, the usage is where the row says and equals the worker's own, and each request has one
usage record with the same tokens."""

from __future__ import annotations

import uuid
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.conftest import REDIS_URL
from tests.e2e.conftest import Fleet, Sdk
from tests.e2e.records import wait_records

PROMPT = "one two three"
MAX_TOKENS = 3
# The caller's stream_options (None: absent) -> the row of the table.
ROWS: dict[str, dict[str, Any] | None] = {
    "absent": None,
    "empty": {},
    "openai": {"include_usage": True},
    "none": {"include_usage": False},
    "continuous": {"continuous_usage_stats": True},
}


def stream(client: openai.OpenAI, kind: str, options: dict[str, Any] | None, n: int) -> Any:
    rid = f"su-{uuid.uuid4().hex}"
    extra: dict[str, Any] = {} if options is None else {"stream_options": options}
    common = dict(model="m1", max_tokens=MAX_TOKENS, n=n, stream=True, **extra)
    headers = {"x-request-id": rid}
    if kind == "chat":
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
        return rid, client.chat.completions.create(
            messages=messages, extra_headers=headers, **common
        )
    return rid, client.completions.create(prompt=PROMPT, extra_headers=headers, **common)


def tutorial_loop(chunks: Any, kind: str, guarded: bool) -> tuple[list[str], list[Any]]:
    """The loop of every tutorial (each choice's text apart); `guarded` (OpenAI's own form)
    skips its usage chunk."""
    texts: dict[int, str] = {}
    seen = []
    for chunk in chunks:
        seen.append(chunk)
        if guarded and not chunk.choices:
            continue
        choice = chunk.choices[0]  # an IndexError here is what this file guards against
        piece = (choice.delta.content or "") if kind == "chat" else choice.text
        texts[choice.index] = texts.get(choice.index, "") + piece
    return [texts[i] for i in sorted(texts)], seen


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("row", ROWS)
def test_the_usage_is_where_the_row_says(
    fleet: Fleet, sdk: Sdk, row: str, kind: str, n: int
) -> None:
    rid, chunks = stream(sdk(fleet.base_url), kind, ROWS[row], n)
    texts, seen = tutorial_loop(chunks, kind, guarded=row == "openai")
    assert [len(text.split()) for text in texts] == [MAX_TOKENS] * n
    expected = {"prompt_tokens": 3, "completion_tokens": MAX_TOKENS * n}
    with_usage = [i for i, c in enumerate(seen) if c.usage is not None]
    last = seen[-1]
    if row == "none":
        assert with_usage == []
    elif row == "openai":
        assert with_usage == [len(seen) - 1] and last.choices == []
    elif row == "continuous":
        assert with_usage == list(range(len(seen)))
        assert all(c.choices for c in seen)
    else:
        assert with_usage == [len(seen) - 1]
        assert last.choices[0].finish_reason == "length"
    if row != "none":
        assert last.usage is not None
        assert last.usage.model_dump(include=set(expected)) == expected
    (record,) = wait_records(REDIS_URL, [rid])[rid]
    assert (int(record["prompt_tokens"]), int(record["completion_tokens"])) == (3, MAX_TOKENS * n)
    assert record["estimated"] == "0"
