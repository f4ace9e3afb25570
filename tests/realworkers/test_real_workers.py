"""The gateway in front of real inference servers (issue 40): vLLM's CPU build and
llama.cpp's llama-server, installed by .ci/real-workers, serving a tiny model the tests made
(conftest.py). Each test runs against each server, through the official openai SDK; what the
gateway says is compared with what the worker says of itself (its answer to the same
request sent directly, its /metrics). Every wait is a bounded poll; no timing is asserted.

The killed-worker test stays last: it kills the worker (and starts it again).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests import conftest as root
from tests.realworkers import calls
from tests.realworkers.conftest import MAX_CONCURRENCY, WORKER_SEQUENCES, Stack
from tests.realworkers.observe import gateway_budget, held, known, poll, samples, usage_record
from tests.realworkers.observe import value as metric
from tests.realworkers.servers import SERVED

# A stack's first test waits for its server to start (vLLM: up to 3 minutes, the model
# loaded and its KV cache allocated on one core).
pytestmark = pytest.mark.timeout(400)
BOTH: list[calls.Kind] = ["chat", "completions"]
ANSWER = 8  # max_tokens of the plain requests: with ignore_eos, always this many


def worker_counts(stack: Stack, kind: calls.Kind) -> tuple[int, int]:
    """The usage the worker itself gives the request, asked directly (not streamed)."""
    return calls.counts(calls.create(stack.client(direct=True), kind, SERVED, ANSWER).usage)


def record_counts(request_id: str) -> tuple[int, int]:
    """The tokens of the request's usage record in Redis (written after the answer)."""
    found = poll("usage record", lambda: usage_record(root.REDIS_URL, request_id))
    return calls.counts(found)


def streamed(stack: Stack, kind: calls.Kind, options: dict[str, Any] | None) -> Any:
    extra = {} if options is None else {"stream_options": options}
    request_id = calls.rid()
    chunks = calls.create(
        stack.client(), kind, stack.model, ANSWER, stream=True, request_id=request_id, **extra
    )
    return request_id, chunks


@pytest.mark.parametrize("kind", BOTH)
def test_an_answer_carries_the_workers_own_usage(stack: Stack, kind: calls.Kind) -> None:
    """A 200 whose usage is the worker's for the same request, as is the usage record."""
    expected = worker_counts(stack, kind)
    assert expected[1] == ANSWER
    request_id = calls.rid()
    raw = calls.create(stack.client(), kind, stack.model, ANSWER, request_id=request_id, raw=True)
    assert raw.status_code == 200
    answer = raw.parse()
    assert answer.model == stack.model
    assert calls.counts(answer.usage) == expected
    assert record_counts(request_id) == expected


@pytest.mark.parametrize("kind", BOTH)
def test_include_usage_ends_with_openais_usage_chunk(stack: Stack, kind: calls.Kind) -> None:
    """`include_usage: true`: the last chunk before [DONE] is `{"choices": [], "usage"}`,
    the only one with a usage, and it is the worker's."""
    expected = worker_counts(stack, kind)
    request_id, chunks = streamed(stack, kind, {"include_usage": True})
    seen = list(chunks)
    assert seen[-1].choices == []
    assert [i for i, c in enumerate(seen) if c.usage is not None] == [len(seen) - 1]
    assert calls.counts(seen[-1].usage) == expected
    assert record_counts(request_id) == expected


@pytest.mark.parametrize("kind", BOTH)
def test_without_stream_options_the_tutorial_loop_runs(stack: Stack, kind: calls.Kind) -> None:
    """No stream_options: `chunk.choices[0]` never fails, and the usage rides the last
    chunk carrying a finish_reason."""
    expected = worker_counts(stack, kind)
    request_id, chunks = streamed(stack, kind, None)
    seen = []
    for chunk in chunks:
        calls.piece(chunk, kind)  # an IndexError here: a chunk with empty choices
        seen.append(chunk)
    finishes = [i for i, c in enumerate(seen) if c.choices[0].finish_reason is not None]
    assert finishes, "no chunk carries a finish_reason"
    assert [i for i, c in enumerate(seen) if c.usage is not None] == [finishes[-1]]
    assert calls.counts(seen[finishes[-1]].usage) == expected
    assert record_counts(request_id) == expected


@pytest.mark.parametrize("kind", BOTH)
def test_include_usage_false_shows_no_usage(stack: Stack, kind: calls.Kind) -> None:
    """`include_usage: false`: no usage anywhere in the stream; the record still has it
    (the gateway always asks the worker for it, for billing)."""
    expected = worker_counts(stack, kind)
    request_id, chunks = streamed(stack, kind, {"include_usage": False})
    seen = list(chunks)
    assert seen and all(c.usage is None for c in seen)
    assert seen[-1].choices and seen[-1].choices[0].finish_reason == "length"
    assert record_counts(request_id) == expected


def test_the_auto_budget_is_the_workers_kv_cache(stack: Stack) -> None:
    """`max_tokens_in_flight: auto`: vLLM's num_gpu_blocks x block_size, as its /metrics
    say (vllm:cache_config_info)."""
    if stack.kind.name == "llama":
        llama_budget_from_props(stack)
        return
    [(labels, _)] = samples(stack.worker.metrics(), "vllm:cache_config_info")
    expected = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    read = poll(
        "auto budget read",
        lambda: known(gateway_budget(stack.gateway.url, stack.model, stack.worker.url)),
    )
    assert read == expected


def llama_budget_from_props(stack: Stack) -> None:
    """llama.cpp's /metrics say nothing of its KV cache (none of its `llamacpp:` names
    does): an `auto` budget is read from its /props instead, a slot's n_ctx times
    total_slots, as the worker itself says them."""
    names = {s for s in metric_names(stack.worker.metrics()) if s.startswith("llamacpp:")}
    assert names and not [n for n in names if "ctx" in n or "kv" in n or "cache_config" in n]
    props = httpx.get(stack.worker.url + "/props", timeout=10.0).json()
    shape = props["default_generation_settings"]["n_ctx"], props["total_slots"]
    assert shape == (stack.kind.context, WORKER_SEQUENCES)
    read = poll(
        "auto budget read from /props",
        lambda: known(gateway_budget(stack.gateway.url, stack.model, stack.worker.url)),
    )
    assert read == shape[0] * shape[1]


def metric_names(text: str) -> set[str]:
    return {line.split("{")[0].split()[0] for line in text.splitlines() if line[:1].isalpha()}


def test_the_worker_never_runs_more_than_max_concurrency(stack: Stack) -> None:
    """3 x max_concurrency requests at once, to a worker that could run 4: its own gauge of
    running requests, polled while they run, never passes the endpoint's max_concurrency."""
    client, n = stack.client(), 3 * MAX_CONCURRENCY
    tokens = stack.kind.load_answer
    seen: list[float] = []
    with ThreadPoolExecutor(n) as pool:
        futures = [
            pool.submit(calls.create, client, "completions", stack.model, tokens) for _ in range(n)
        ]
        while not all(f.done() for f in futures):
            seen.append(metric(stack.worker.metrics(), stack.kind.running) or 0.0)
        answers = [f.result() for f in futures]
    assert [a.usage.completion_tokens for a in answers] == [tokens] * n
    assert max(seen) <= MAX_CONCURRENCY, seen
    assert max(seen) >= 1, "the poll never saw a request running: the bound is not tested"


def idle(stack: Stack) -> bool:
    return metric(stack.worker.metrics(), stack.kind.running) == 0


LLAMA_CANCEL = "stop: cancel task"  # llama-server's log line of a task it cancelled


def test_a_caller_hanging_up_mid_stream_aborts_the_workers_request(stack: Stack) -> None:
    """The caller closes the stream after its first chunk: the worker ends the request
    long before its max_tokens (its own count of generated tokens grows by less, once it
    runs nothing) and logs the abort (vLLM under the request's x-request-id). Neither
    server counts a client's abort in its /metrics: vLLM's `request_success_total
    {finished_reason="abort"}` stays 0, llama.cpp has no such counter."""
    tokens = stack.kind.long_answer
    poll("worker idle", lambda: idle(stack))
    before = metric(stack.worker.metrics(), stack.kind.generated) or 0.0
    cancels = stack.worker.log.read_text(errors="replace").count(LLAMA_CANCEL)
    request_id = calls.rid()
    chunks = calls.create(
        stack.client(), "completions", stack.model, tokens, stream=True, request_id=request_id
    )
    next(iter(chunks))
    chunks.close()
    poll("worker idle", lambda: idle(stack))
    grown = (metric(stack.worker.metrics(), stack.kind.generated) or 0.0) - before
    assert grown < tokens
    line = f"Request cmpl-{request_id}-0 aborted." if stack.kind.name == "vllm" else None
    poll("the worker's log of the abort", lambda: logged_abort(stack, line, cancels))
    record = poll("usage record", lambda: usage_record(root.REDIS_URL, request_id))
    assert (record["status"], record["outcome"]) == ("499", "cancelled")
    poll("its slot given back", lambda: held(root.REDIS_URL, stack.model) == 0)


def logged_abort(stack: Stack, line: str | None, cancels_before: int) -> bool:
    log = stack.worker.log.read_text(errors="replace")
    return line in log if line is not None else log.count(LLAMA_CANCEL) > cancels_before


@pytest.mark.parametrize("kind", BOTH)
def test_a_prompt_longer_than_the_context_is_a_400(stack: Stack, kind: calls.Kind) -> None:
    """The worker's own refusal passes through as a 400 in the OpenAI envelope, marked
    as not to be retried."""
    prompt = "one " * (stack.kind.context + 50)
    with pytest.raises(openai.BadRequestError) as caught:
        calls.create(stack.client(), kind, stack.model, ANSWER, prompt=prompt)
    error = caught.value
    assert error.status_code == 400
    assert isinstance(error.body, dict) and error.body["type"] == "invalid_request_error"
    assert error.response.headers.get("x-should-retry") == "false"
    assert held(root.REDIS_URL, stack.model) == 0


def refusal(stack: Stack, seen: list[tuple[int, Any]]) -> bool:
    """One request to the dead worker's model: its status and code noted; True at the 503
    of a model with no endpoint in rotation."""
    try:
        calls.create(stack.client(), "completions", stack.model, 2)
    except openai.APIStatusError as error:
        body = error.body if isinstance(error.body, dict) else {}
        seen.append((error.status_code, body.get("code")))
        return seen[-1] == (503, "service_unavailable")
    raise AssertionError("a killed worker answered")


def test_a_killed_worker_gives_502_or_503_and_its_slot_comes_back(stack: Stack) -> None:
    """kill -9 of the worker under a running stream: the stream ends with an error event,
    the next requests get docs/api.md's 502 upstream_unavailable, then 503 once the
    endpoint is out; no lease stays held; started again, the worker serves both slots."""
    stream_id = calls.rid()
    chunks = calls.create(
        stack.client(), "completions", stack.model, stack.kind.long_answer, stream=True,
        request_id=stream_id,
    )  # fmt: skip
    next(iter(chunks))
    stack.worker.kill()
    with pytest.raises(openai.APIError):
        for _ in chunks:
            pass
    seen: list[tuple[int, Any]] = []
    poll("503 service_unavailable", lambda: refusal(stack, seen))
    assert set(seen) <= {(502, "upstream_unavailable"), (503, "service_unavailable")}, seen
    record = poll("usage record", lambda: usage_record(root.REDIS_URL, stream_id))
    assert record["status"] == "502"
    poll("no lease held", lambda: held(root.REDIS_URL, stack.model) == 0)
    stack.worker.start()
    poll("endpoint back in rotation", stack.endpoint_up, limit_s=60.0)
    with ThreadPoolExecutor(MAX_CONCURRENCY) as pool:
        jobs = [
            pool.submit(calls.create, stack.client(), "completions", stack.model, ANSWER)
            for _ in range(MAX_CONCURRENCY)
        ]
        assert [job.result().usage.completion_tokens for job in jobs] == [ANSWER] * 2
