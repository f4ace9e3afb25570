"""Request models of the two POST routes: seed bodies validate, every bound is a 422."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from gateway.schemas import ChatRequest, CompletionRequest

MODEL = "meta-llama/Llama-2-70b-chat-hf"


def completion_body() -> dict[str, Any]:
    """The request body of the seed's client examples (000_*.txt), every field set."""
    return {
        "model": MODEL,
        "prompt": "<string>",
        "fail_fast": False,
        "models": ["<string>"],
        "max_tokens": 5000000,
        "temperature": 1,
        "top_p": 1,
        "min_p": 0,
        "top_k": 0,
        "n": 1,
        "stream": False,
        "logprobs": 123,
        "echo": True,
        "stop": "<string>",
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "response_format": {"type": "text"},
        "repetition_penalty": 1,
        "user": "<string>",
        "seed": 4611686018427388000,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        "stop_token_ids": [123],
        "return_tokens_as_token_ids": True,
        "prompt_cache_key": "<string>",
        "prompt_cache_options": {},
        "data": {"image": ["<string>"], "video": ["<string>"]},
        "ignore_eos": True,
    }


def chat_body() -> dict[str, Any]:
    """A chat body using every field of the chat reference (002_*.txt)."""
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this image?", "cache_control": {}},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                    {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
                    {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "thinking",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
            {"role": "user", "content": "Thanks", "name": "bob"},
        ],
        "service_tier": "priority",
        "fail_fast": False,
        "models": [MODEL, "mistralai/Mixtral-8x7B-Instruct-v0.1", MODEL],
        "stream": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "min_p": 0.05,
        "top_k": 40,
        "max_tokens": 512,
        "stop": ["\n\n", "END"],
        "stop_token_ids": [2, 32000],
        "n": 2,
        "presence_penalty": -0.5,
        "frequency_penalty": 1.5,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather by city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                    "strict": True,
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": {"type": "object"}, "strict": True},
        },
        "repetition_penalty": 1.1,
        "user": "user-123",
        "seed": -(2**63),
        "logprobs": True,
        "top_logprobs": 20,
        "stream_options": {"include_usage": False},
        "reasoning_effort": "xhigh",
        "reasoning": {"effort": "low", "max_tokens": 1024, "enabled": True, "exclude": False},
        "prompt_cache_key": "conv-1",
        "prompt_cache_options": {"mode": "explicit", "ttl": "1h"},
        "cache_salt": "tenant-a",
        "chat_template_kwargs": {"enable_thinking": False},
        "media_io_kwargs": {"video": {"num_frames": 16}},
        "continue_final_message": False,
        "ignore_eos": False,
        "echo": False,
        "return_tokens_as_token_ids": False,
    }


def test_seed_completion_body_validates_and_keeps_extras() -> None:
    body = completion_body() | {"guided_json": {"type": "object"}, "priority": 3}
    req = CompletionRequest.model_validate(orjson.loads(orjson.dumps(body)))
    assert req.model == MODEL
    assert req.prompt == "<string>"
    assert req.models == ["<string>"]
    assert req.stream is False
    assert req.stream_options is not None and req.stream_options.include_usage is True
    assert req.seed == 4611686018427388000
    assert req.fail_fast is False and req.service_tier is None
    assert req.model_extra == {"guided_json": {"type": "object"}, "priority": 3}


def test_seed_chat_body_validates_and_keeps_extras() -> None:
    body = chat_body() | {"parallel_tool_calls": False, "logit_bias": {"50256": -100}}
    req = ChatRequest.model_validate(orjson.loads(orjson.dumps(body)))
    assert req.stream is True
    assert req.service_tier == "priority"
    assert req.models is not None and len(req.models) == 3  # duplicates are the router's job
    assert req.cache_salt == "tenant-a" and req.prompt_cache_key == "conv-1"
    assert req.user == "user-123"
    assert req.stream_options is not None and req.stream_options.include_usage is False
    assert req.model_extra == {"parallel_tool_calls": False, "logit_bias": {"50256": -100}}
    # Extra keys inside nested objects survive too (e.g. Anthropic-style cache_control).
    user_parts = req.messages[2].content
    assert isinstance(user_parts, list)
    assert user_parts[0].model_extra == {"cache_control": {}}
    assert user_parts[2].model_extra == {"input_audio": {"data": "AA", "format": "wav"}}


@pytest.mark.parametrize("model", [CompletionRequest, ChatRequest])
def test_minimal_bodies_get_seed_defaults(model: type[BaseModel]) -> None:
    body: dict[str, Any] = {"model": MODEL}
    if model is CompletionRequest:
        body["prompt"] = [1, 2, 3]
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    req = model.model_validate(body)
    assert isinstance(req, CompletionRequest | ChatRequest)
    assert (req.temperature, req.top_p, req.top_k, req.n) == (1.0, 1.0, 0, 1)
    assert (req.stream, req.fail_fast, req.models, req.service_tier) == (False, False, None, None)


@pytest.mark.parametrize(
    ("prompt", "seen"),
    [("hi", "hi"), (["hi"], "hi"), ([""], ""), ([1, 2], [1, 2])],
)
def test_one_prompt_as_text_one_string_list_or_token_ids(prompt: Any, seen: Any) -> None:
    body = completion_body() | {"prompt": prompt}
    req = CompletionRequest.model_validate(body)
    assert req.prompt == seen
    # The worker sees the seed's shape: a one-string list goes on as its string.
    assert req.for_worker(body) == body | {"prompt": seen}


@pytest.mark.parametrize(
    ("prompt", "count"), [(["a", "b"], 2), (["a"] * 64, 64), ([[1, 2]], 1), ([[1], [2, 3]], 2)]
)
def test_a_batch_of_prompts_is_accepted_as_it_is(prompt: Any, count: int) -> None:
    """OpenAI's and vLLM's list of prompts: one request, forwarded as the list."""
    body = completion_body() | {"prompt": prompt}
    req = CompletionRequest.model_validate(body)
    assert (req.prompt, req.prompt_count) == (prompt, count)
    assert req.for_worker(body) == body


@pytest.mark.parametrize(
    ("prompt", "loc", "kind"),
    [
        ([], ("prompt", "list"), "too_short"),
        (["a"] * 65, ("prompt", "texts"), "too_long"),
        (["a", 1], ("prompt", "texts", 1), "string_type"),
        ([[]], ("prompt", "batch", 0), "too_short"),
        ([[1], "a"], ("prompt", "batch", 1), "list_type"),
        ([["a"]], ("prompt", "batch", 0, 0), "int_type"),
        ({"text": "a"}, ("prompt",), "shape_error"),
    ],
)
def test_a_bad_prompt_list_is_refused_naming_the_place(prompt: Any, loc: Any, kind: str) -> None:
    """No prompt at all, too many, or a mixed batch is refused before a slot is taken."""
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(completion_body() | {"prompt": prompt})
    [error] = info.value.errors()
    assert (error["loc"], error["type"]) == (loc, kind)


@pytest.mark.parametrize("tier", ["default", "priority", "flex", "auto", "standard_only", None])
def test_service_tier_values(tier: str | None) -> None:
    assert CompletionRequest.model_validate(completion_body() | {"service_tier": tier})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 10_000_000),
        ("max_tokens", None),
        ("top_k", 999),
        ("top_p", 1e-9),
        ("seed", 2**64 - 1),
        ("seed", -(2**63)),
        ("stop", ["s"] * 16),
        ("stop_token_ids", list(range(16))),
        ("repetition_penalty", 0.01),
        ("temperature", 2),
        ("models", ["a", "b", "c", "d"]),
        ("models", ["Qwen/Qwen3-235B-A22B-Instruct-2507", "x" * 256]),
    ],
)
def test_bounds_inclusive_edges_accept(field: str, value: Any) -> None:
    CompletionRequest.model_validate(completion_body() | {field: value})
    ChatRequest.model_validate(chat_body() | {field: value})


# (field, value) pairs that each route must answer with a 422 naming that field.
SHARED_BAD: list[tuple[str, Any]] = [
    ("temperature", 2.1),
    ("temperature", -0.1),
    ("temperature", "0.5"),
    ("temperature", True),
    ("top_p", 0),
    ("top_p", 1.1),
    ("min_p", 1.5),
    ("min_p", -0.1),
    ("top_k", 1000),
    ("top_k", -1),
    ("top_k", 1.5),
    ("n", 0),
    ("n", 5),
    ("max_tokens", 0),
    ("max_tokens", 10_000_001),
    ("max_tokens", "100"),
    ("presence_penalty", -2.1),
    ("presence_penalty", 2.1),
    ("frequency_penalty", -2.1),
    ("frequency_penalty", 2.1),
    ("repetition_penalty", 0),
    ("repetition_penalty", 5.1),
    ("stop", ["s"] * 17),
    ("stop", [1]),
    ("stop", 5),
    ("stop_token_ids", list(range(17))),
    ("stop_token_ids", ["1"]),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("models", ["m"] * 5),
    ("models", []),
    ("models", ["deploy_id:x"]),
    ("models", ["a:b"]),
    ("models", ["host:8000"]),
    ("models", ["a@b"]),
    ("models", ["a b"]),
    ("models", [""]),
    ("models", ["x" * 257]),
    ("service_tier", "gold"),
    ("service_tier", "Priority"),
    ("stream", "maybe"),
    # Booleans are strict: pydantic's lax mode took these as true or false, and the worker
    # was sent the string or the number (found by an outside attack: a slot taken, a
    # worker's 400 billed).
    ("stream", "true"),
    ("stream", 1),
    ("stream", 0),
    ("stream", "yes"),
    ("fail_fast", 1),
    ("fail_fast", "false"),
    ("stream_options", {"include_usage": "often"}),
    ("stream_options", {"include_usage": 1}),
    ("stream_options", {"continuous_usage_stats": "true"}),
    ("prompt_cache_options", {"ttl": "2h"}),
    ("prompt_cache_options", {"mode": "always"}),
    ("response_format", {"type": "json_schema"}),
    ("response_format", {"type": "regex"}),
    ("response_format", {"type": "grammar"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
    ("user", 5),
    ("model", None),
]

COMPLETION_BAD: list[tuple[str, Any]] = [
    ("prompt", ["a"] * 65),
    ("prompt", [["1"]]),
    ("prompt", ["a", 1]),
    ("prompt", [1, "a"]),
    ("prompt", [[1], ["2"]]),
    ("prompt", 5),
    ("prompt", None),
    ("logprobs", -1),
    ("data", {"image": "not-a-list"}),
    ("echo", "true"),
    ("echo", 1),
    ("ignore_eos", "yes"),
    ("return_tokens_as_token_ids", 0),
]

CHAT_BAD: list[tuple[str, Any]] = [
    ("messages", []),
    ("messages", [{"role": "robot", "content": "hi"}]),
    ("messages", [{"content": "hi"}]),
    ("messages", ["hi"]),
    ("messages", [{"role": "tool", "content": "sunny"}]),
    ("messages", [{"role": "user"}]),
    ("messages", [{"role": "user", "content": [{"type": "text"}]}]),
    ("messages", [{"role": "user", "content": [{"text": "no type"}]}]),
    ("messages", [{"role": "user", "content": [{"type": 5}]}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    ("messages", [{"role": "system", "content": [{"type": "image_url"}]}]),
    ("messages", [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]),
    ("tools", [{"type": "function", "function": {"name": ""}}]),
    ("tools", [{"type": "function", "function": {"name": "f" * 65}}]),
    ("tools", [{"type": "retrieval"}]),
    ("tool_choice", "always"),
    ("tool_choice", 5),
    ("messages", [{"role": "system", "content": {"text": "not a list"}}]),
    ("tool_choice", {"type": "function"}),
    ("logprobs", "yes please"),
    ("top_logprobs", 21),
    ("top_logprobs", -1),
    ("reasoning_effort", "extreme"),
    ("reasoning", {"effort": "extreme"}),
    ("reasoning", {"max_tokens": 0}),
    ("cache_salt", ""),
    ("chat_template_kwargs", ["x"]),
    ("media_io_kwargs", {"video": 16}),
    ("logprobs", "true"),
    ("logprobs", 1),
    ("continue_final_message", "false"),
    ("reasoning", {"enabled": 1}),
]


def _first_loc(model: type[BaseModel], body: dict[str, Any]) -> tuple[int | str, ...]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return info.value.errors()[0]["loc"]


def _with(body: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    body = copy.deepcopy(body)
    if value is None and field in ("model", "prompt"):
        del body[field]  # required fields: absence, not null, is the interesting case
    else:
        body[field] = value
    return body


@pytest.mark.parametrize(("field", "value"), SHARED_BAD + COMPLETION_BAD)
def test_completion_out_of_bounds_is_rejected_at_field(field: str, value: Any) -> None:
    assert _first_loc(CompletionRequest, _with(completion_body(), field, value))[0] == field


@pytest.mark.parametrize(("field", "value"), SHARED_BAD + CHAT_BAD)
def test_chat_out_of_bounds_is_rejected_at_field(field: str, value: Any) -> None:
    assert _first_loc(ChatRequest, _with(chat_body(), field, value))[0] == field


def test_error_locations_point_inside_lists() -> None:
    assert _first_loc(CompletionRequest, completion_body() | {"models": ["ok", "a:b"]}) == (
        "models",
        1,
    )
    tool_msg = {"role": "tool", "content": "sunny"}
    loc = _first_loc(ChatRequest, chat_body() | {"messages": [tool_msg]})
    assert loc[:2] == ("messages", 0) and loc[-1] == "tool_call_id"


@pytest.mark.parametrize("text", [b"18446744073709551616", b"-9223372036854775809"])
def test_json_numbers_beyond_64_bits_are_rejected(text: bytes) -> None:
    # orjson turns integers beyond 64 bits into floats; strict ints must refuse them.
    body = orjson.loads(b'{"model": "m", "prompt": "p", "seed": ' + text + b"}")
    assert _first_loc(CompletionRequest, body) == ("seed",)


def test_union_errors_name_only_the_member_the_caller_meant() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(completion_body() | {"stop": ["s"] * 17})
    assert [(e["loc"], e["type"]) for e in info.value.errors()] == [(("stop", "list"), "too_long")]


def test_non_finite_numbers_are_rejected() -> None:
    for value in (float("inf"), float("nan")):
        assert _first_loc(CompletionRequest, completion_body() | {"temperature": value}) == (
            "temperature",
        )


def test_both_schemas_render() -> None:
    completion = CompletionRequest.model_json_schema()
    chat = ChatRequest.model_json_schema()
    assert completion["title"] == "OpenAICompletionsIn"
    assert set(completion["required"]) == {"model", "prompt"}
    assert set(chat["required"]) == {"model", "messages"}
    assert "ChatCompletionToolMessage" in chat["$defs"]
    orjson.dumps(completion)
    orjson.dumps(chat)


# Arbitrary JSON values: the models must answer with a ValidationError or accept, never crash.
def _json_values(max_int: int) -> st.SearchStrategy[Any]:
    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-max_int, max_value=max_int)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=20),
        lambda children: (
            st.lists(children, max_size=5)
            | st.dictionaries(st.text(max_size=12), children, max_size=6)
        ),
        max_leaves=25,
    )


JSON_VALUES = _json_values(2**63 - 1)  # what orjson can encode
WIDE_VALUES = _json_values(2**70)  # beyond 64 bits, only reachable from Python
FIELD_NAMES = st.sampled_from(
    sorted(set(ChatRequest.model_fields) | set(CompletionRequest.model_fields))
)
# Bodies close to valid ones, so that fuzzing reaches the inner validators, not just "model".
NEAR_VALID = st.builds(
    lambda base, patch: base | patch,
    st.sampled_from([completion_body(), chat_body()]),
    st.dictionaries(FIELD_NAMES, WIDE_VALUES, max_size=4),
)


def _validate_both(body: Any) -> None:
    for model in (CompletionRequest, ChatRequest):
        with contextlib.suppress(ValidationError):
            model.model_validate(body)


@settings(max_examples=200, deadline=None)
@given(st.one_of(WIDE_VALUES, NEAR_VALID))
def test_fuzzed_json_only_validates_or_raises_validation_error(body: Any) -> None:
    # No orjson round trip: Python ints beyond 64 bits are the harsher input.
    _validate_both(body)


# hypothesis_jsonschema 0.23.1 (the newest release) calls Hypothesis internals that
# hypothesis 6.170 removed (`cu.many(...).more()`), so its from_schema() crashes on any object
# schema. The small translator below covers the subset of JSON Schema that pydantic emits for
# these two models, which is all this test needs.
def _from_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        return st.deferred(lambda: _from_schema(target, defs))
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([_from_schema(sub, defs) for sub in schema[key]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        if kind == "integer":
            # Unbounded JSON integers stay in 64 bits: beyond that orjson reads floats.
            lo = -(2**63) if low is None else low + ("exclusiveMinimum" in schema)
            hi = 2**64 - 1 if high is None else high - ("exclusiveMaximum" in schema)
            return st.integers(min_value=lo, max_value=hi)
        return st.floats(
            min_value=low,
            max_value=high,
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "string":
        min_len: int = schema.get("minLength", 0)
        max_len: int = schema.get("maxLength", 24)
        strings = (
            st.from_regex(schema["pattern"], fullmatch=True)
            if "pattern" in schema
            else st.text(min_size=min_len, max_size=min(max_len, 24))
        )
        excluded: list[str] = schema.get("not", {}).get("enum", [])

        def fits(text: str) -> bool:
            return min_len <= len(text) <= max_len and text not in excluded

        return strings.filter(fits)
    if kind == "array":
        low = schema.get("minItems", 0)
        high = min(schema.get("maxItems", 4), low + 4)
        return st.lists(_from_schema(schema.get("items", {}), defs), min_size=low, max_size=high)
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        extra = schema.get("additionalProperties", False)
        extra_values = JSON_VALUES if extra is True else _from_schema(extra or {}, defs)
        fixed = st.fixed_dictionaries(
            {name: _from_schema(sub, defs) for name, sub in props.items() if name in required},
            optional={
                name: _from_schema(sub, defs) for name, sub in props.items() if name not in required
            },
        )
        if extra is False:
            return fixed
        extras = st.dictionaries(
            st.text(max_size=10).filter(lambda key: key not in props), extra_values, max_size=3
        )
        return st.builds(lambda known, more: more | known, fixed, extras)
    return JSON_VALUES


# Instances of the published JSON schema must be accepted: /openapi.json must not promise
# bodies that the gateway then refuses.
@pytest.mark.slow
@pytest.mark.parametrize("model", [CompletionRequest, ChatRequest])
def test_schema_derived_bodies_validate(model: type[BaseModel]) -> None:
    schema = model.model_json_schema()

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_from_schema(schema, schema.get("$defs", {})))
    def check(body: dict[str, Any]) -> None:
        model.model_validate(orjson.loads(orjson.dumps(body)))

    check()
