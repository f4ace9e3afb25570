"""The simulated worker, run for real under uvicorn and spoken to with the openai SDK and httpx."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim import SimOptions, build_sim_app
from gateway.sim.load import Slots

StartSim = Callable[..., Awaitable[str]]

# Generous bound for polling loops; they normally end after a few iterations.
POLL_ROUNDS = 500
POLL_PAUSE = 0.01


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    """Start simulators on free loopback ports: `url = await start_sim(max_seqs=1, ...)`."""
    running: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    async def start(**fields: Any) -> str:
        fields.setdefault("ttft_ms", 0)
        fields.setdefault("itl_ms", 0)
        config = uvicorn.Config(
            build_sim_app(SimOptions(**fields)),
            host="127.0.0.1",
            port=0,
            http="httptools",
            ws="none",
            lifespan="on",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        running.append((server, task))
        for _ in range(POLL_ROUNDS):
            if server.started:
                port = server.servers[0].sockets[0].getsockname()[1]
                return f"http://127.0.0.1:{port}"
            if task.done():
                task.result()
            await asyncio.sleep(POLL_PAUSE)
        raise AssertionError("the simulator did not start")

    yield start
    for server, _ in running:
        server.should_exit = True
    await asyncio.gather(*(task for _, task in running))


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


async def metric(http: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    response = await http.get(f"{url}/metrics")
    assert response.status_code == 200
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name} {labels} not in /metrics")


async def wait_metric(
    http: httpx.AsyncClient, url: str, name: str, value: float, **labels: str
) -> None:
    seen = None
    for _ in range(POLL_ROUNDS):
        seen = await metric(http, url, name, **labels)
        if seen == value:
            return
        await asyncio.sleep(POLL_PAUSE)
    raise AssertionError(f"{name} {labels} stayed at {seen}, expected {value}")


async def finished(http: httpx.AsyncClient, url: str, reason: str) -> float:
    return await metric(
        http, url, "vllm:request_success_total", finished_reason=reason, model_name="sim-model"
    )


async def test_completion(start_sim: StartSim) -> None:
    url = await start_sim(tokens=12)
    async with sdk(url) as client:
        result = await client.completions.create(model="sim-model", prompt="say three words now")
    assert result.id.startswith("cmpl-")
    assert result.object == "text_completion"
    assert result.model == "sim-model"
    assert len(result.choices) == 1
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert len(choice.text.split()) == 12
    assert result.usage is not None
    assert result.usage.prompt_tokens == 4
    assert result.usage.completion_tokens == 12
    assert result.usage.total_tokens == 16


async def test_completion_with_token_ids_and_n(start_sim: StartSim) -> None:
    url = await start_sim(tokens=5)
    async with sdk(url) as client:
        result = await client.completions.create(model="sim-model", prompt=[1, 2, 3], n=3)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert all(len(c.text.split()) == 5 for c in result.choices)
    assert len({c.text for c in result.choices}) > 1  # each choice is generated on its own
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, 15)


async def test_chat_completion(start_sim: StartSim) -> None:
    url = await start_sim(tokens=7)
    messages: Any = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello there you"}]},
    ]
    async with sdk(url) as client:
        result = await client.chat.completions.create(model="sim-model", messages=messages)
    assert result.id.startswith("chatcmpl-")
    assert result.object == "chat.completion"
    message = result.choices[0].message
    assert message.role == "assistant"
    assert message.content is not None
    assert len(message.content.split()) == 7
    assert result.choices[0].finish_reason == "stop"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (5, 7)


@pytest.mark.parametrize("itl_ms", [0, 1])
async def test_completion_stream_with_usage(start_sim: StartSim, itl_ms: float) -> None:
    url = await start_sim(tokens=6, itl_ms=itl_ms)
    async with sdk(url) as client:
        plain = await client.completions.create(model="sim-model", prompt="a b", seed=4)
        stream = await client.completions.create(
            model="sim-model",
            prompt="a b",
            seed=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    *token_chunks, usage_chunk = chunks
    assert len(token_chunks) == 6  # one event per token
    assert all(c.object == "text_completion" and c.usage is None for c in token_chunks)
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 5 + ["stop"]
    assert "".join(c.choices[0].text for c in token_chunks) == plain.choices[0].text
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert plain.usage is not None
    assert usage_chunk.usage.model_dump() == plain.usage.model_dump()


async def test_chat_stream_with_usage(start_sim: StartSim) -> None:
    url = await start_sim(tokens=4)
    async with sdk(url) as client:
        stream = await client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "one two"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    first, *content_chunks, usage_chunk = chunks
    assert first.object == "chat.completion.chunk"
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == ""
    assert len(content_chunks) == 3
    assert [c.choices[0].finish_reason for c in content_chunks] == [None, None, "length"]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens == 2
    assert usage_chunk.usage.completion_tokens == len(text.split()) == 3


async def test_stream_without_usage_ends_with_done(
    start_sim: StartSim, http: httpx.AsyncClient
) -> None:
    url = await start_sim(tokens=2)
    body = {"model": "sim-model", "prompt": "x", "stream": True}
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line async for line in response.aiter_lines() if line]
    assert len(events) == 3
    assert events[-1] == "data: [DONE]"
    assert '"usage"' not in events[0]


async def test_max_tokens_cuts_with_length(start_sim: StartSim) -> None:
    url = await start_sim(tokens=8)
    async with sdk(url) as client:
        short = await client.completions.create(model="sim-model", prompt="p", max_tokens=3)
        roomy = await client.completions.create(model="sim-model", prompt="p", max_tokens=50)
    assert short.choices[0].finish_reason == "length"
    assert len(short.choices[0].text.split()) == 3
    assert roomy.choices[0].finish_reason == "stop"
    assert len(roomy.choices[0].text.split()) == 8
    assert roomy.choices[0].text.startswith(short.choices[0].text)


async def test_text_is_deterministic_from_seed_and_prompt(start_sim: StartSim) -> None:
    url = await start_sim(tokens=16)
    async with sdk(url) as client:

        async def text(prompt: str, seed: int | None) -> str:
            result = await client.completions.create(model="sim-model", prompt=prompt, seed=seed)
            return result.choices[0].text

        assert await text("hello", 1) == await text("hello", 1)
        assert await text("hello", None) == await text("hello", 0)
        assert await text("hello", 1) != await text("hello", 2)
        assert await text("hello", 1) != await text("goodbye", 1)


async def test_unknown_model_is_vllm_404(start_sim: StartSim, http: httpx.AsyncClient) -> None:
    url = await start_sim()
    async with sdk(url) as client:
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt="x")
    response = await http.post(f"{url}/v1/chat/completions", json={"model": "x", "messages": []})
    assert response.status_code == 400  # the body is checked before the model, as in vLLM
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    response = await http.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 404
    assert response.json() == {
        "object": "error",
        "message": "The model `x` does not exist.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }


MALFORMED_BODIES = [
    b"{not json",
    b"[1, 2]",
    b'{"model": "sim-model"}',
    b'{"model": "sim-model", "prompt": "x", "max_tokens": 0}',
    b'{"model": "sim-model", "prompt": "x", "n": "2"}',
    b'{"model": "sim-model", "prompt": "x", "stream": "yes"}',
    b'{"model": "sim-model", "prompt": []}',
]


async def test_malformed_body_is_vllm_400(start_sim: StartSim, http: httpx.AsyncClient) -> None:
    url = await start_sim()
    for body in MALFORMED_BODIES:
        response = await http.post(f"{url}/v1/completions", content=body)
        assert response.status_code == 400, body
        error = response.json()
        assert (error["object"], error["type"], error["code"]) == ("error", "BadRequestError", 400)
        assert error["message"]
    chat = {"model": "sim-model", "messages": [{"role": "user", "content": 3}]}
    response = await http.post(f"{url}/v1/chat/completions", json=chat)
    assert response.status_code == 400


async def test_models_health_and_unknown_routes(
    start_sim: StartSim, http: httpx.AsyncClient
) -> None:
    url = await start_sim(models=("a", "b"))
    async with sdk(url) as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == ["a", "b"]
    health = await http.get(f"{url}/health")
    assert (health.status_code, health.content) == (200, b"")
    assert (await http.get(f"{url}/nowhere")).status_code == 404
    assert (await http.get(f"{url}/v1/completions")).status_code == 405


async def test_metrics_count_stop_length_and_stream_abort(
    start_sim: StartSim, http: httpx.AsyncClient
) -> None:
    url = await start_sim(tokens=25, itl_ms=20)
    assert await finished(http, url, "abort") == 0
    async with sdk(url) as client:
        await client.completions.create(model="sim-model", prompt="x", max_tokens=2)
        await client.completions.create(model="sim-model", prompt="x", max_tokens=2)
        messages: Any = [{"role": "user", "content": "hi"}]
        full = asyncio.create_task(
            client.chat.completions.create(model="sim-model", messages=messages, max_tokens=60)
        )
        stream = await client.completions.create(model="sim-model", prompt="x", stream=True)
        received = 0
        async for _ in stream:
            received += 1
            if received == 2:
                break
        await stream.close()
        await full
    await wait_metric(
        http, url, "vllm:request_success_total", 1, finished_reason="abort", model_name="sim-model"
    )
    assert await finished(http, url, "length") == 2
    assert await finished(http, url, "stop") == 1
    assert await metric(http, url, "vllm:num_requests_running") == 0
    assert await metric(http, url, "vllm:kv_cache_usage_perc") == 0


async def test_non_stream_abort_when_client_gives_up(
    start_sim: StartSim, http: httpx.AsyncClient
) -> None:
    url = await start_sim(ttft_ms=60_000)
    body = {"model": "sim-model", "prompt": "x"}
    request = asyncio.create_task(http.post(f"{url}/v1/completions", json=body))
    await wait_metric(http, url, "vllm:num_requests_running", 1)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    await wait_metric(
        http, url, "vllm:request_success_total", 1, finished_reason="abort", model_name="sim-model"
    )
    assert await metric(http, url, "vllm:num_requests_running") == 0


async def test_max_seqs_queues_the_rest(start_sim: StartSim, http: httpx.AsyncClient) -> None:
    url = await start_sim(max_seqs=1, ttft_ms=60_000)
    body = {"model": "sim-model", "prompt": "x"}
    async with httpx.AsyncClient(timeout=30) as other:
        requests = [asyncio.create_task(other.post(f"{url}/v1/completions", json=body))]
        await wait_metric(http, url, "vllm:num_requests_running", 1)
        requests.append(asyncio.create_task(other.post(f"{url}/v1/completions", json=body)))
        await wait_metric(http, url, "vllm:num_requests_waiting", 1)
        assert await metric(http, url, "vllm:num_requests_running") == 1
        assert await metric(http, url, "vllm:kv_cache_usage_perc") == 1
        for request in requests:
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
    await wait_metric(
        http, url, "vllm:request_success_total", 2, finished_reason="abort", model_name="sim-model"
    )
    assert await metric(http, url, "vllm:num_requests_running") == 0
    assert await metric(http, url, "vllm:num_requests_waiting") == 0


async def test_slots_are_fifo_and_survive_cancelled_waiters() -> None:
    slots = Slots(1)
    await slots.acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        await slots.acquire()
        order.append(name)

    waiters = {name: asyncio.create_task(wait(name)) for name in "abc"}
    await asyncio.sleep(0)
    assert slots.waiting == 3
    waiters["b"].cancel()
    slots.release()
    await asyncio.sleep(0)
    slots.release()
    await asyncio.gather(*waiters.values(), return_exceptions=True)
    assert order == ["a", "c"]
    assert (slots.running, slots.waiting) == (1, 0)


async def test_peak_reports_the_window_and_the_spans_of_ended_requests(
    start_sim: StartSim, http: httpx.AsyncClient
) -> None:
    url = await start_sim(max_seqs=1, ttft_ms=30, itl_ms=10, tokens=4)
    body = {"model": "sim-model", "prompt": "x"}
    before = time.monotonic()
    answers = await asyncio.gather(
        *(http.post(f"{url}/v1/completions", json=body, headers={"x-request-id": f"r{i}"})
          for i in range(3))
    )  # fmt: skip
    assert [a.status_code for a in answers] == [200, 200, 200]
    async with http.stream(
        "POST", f"{url}/v1/completions", json=body | {"stream": True, "max_tokens": 4000},
        headers={"x-request-id": "gone"},
    ) as stream:  # fmt: skip
        await anext(stream.aiter_bytes())
    await wait_metric(
        http, url, "vllm:request_success_total", 1, finished_reason="abort", model_name="sim-model"
    )
    peak = (await http.get(f"{url}/sim/peak")).json()
    assert (peak["running"], peak["waiting"]) == (0, 0)
    # Three at once on one slot: one ran while two waited.
    assert (peak["peak_running"], peak["peak_waiting"], peak["peak_inflight"]) == (1, 2, 3)
    spans = {rid: (start, end, aborted) for rid, start, end, aborted in peak["spans"]}
    assert set(spans) == {"r0", "r1", "r2", "gone"}
    assert all(before <= start <= end <= time.monotonic() for start, end, _ in spans.values())
    assert [spans[rid][2] for rid in ("r0", "r1", "r2", "gone")] == [False, False, False, True]
    # The slot is FIFO and held in turn: the three spans' ends are at least one answer apart.
    ends = sorted(spans[rid][1] for rid in ("r0", "r1", "r2"))
    assert ends[1] - ends[0] >= 0.03 and ends[2] - ends[1] >= 0.03
    again = (await http.get(f"{url}/sim/peak")).json()
    assert (again["peak_inflight"], again["spans"], again["spans_dropped"]) == (0, [], 0)
    # The all-time peaks in /metrics stay.
    assert await metric(http, url, "sim:peak_requests_waiting", model_name="sim-model") == 2


async def test_recent_requests_record_body_and_headers(
    start_sim: StartSim, http: httpx.AsyncClient
) -> None:
    url = await start_sim()
    body = {"model": "sim-model", "prompt": "x", "custom_field": [1, {"a": None}]}
    await http.post(f"{url}/v1/completions", json=body, headers={"X-Trace": "t-1"})
    async with sdk(url) as client:
        await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}]
        )
    recorded = (await http.get(f"{url}/sim/requests")).json()["requests"]
    assert [r["path"] for r in recorded] == ["/v1/completions", "/v1/chat/completions"]
    assert recorded[0]["body"] == body
    assert recorded[0]["headers"]["x-trace"] == "t-1"
    assert recorded[1]["headers"]["authorization"] == "Bearer x"
    assert (await http.delete(f"{url}/sim/requests")).status_code == 200
    assert (await http.get(f"{url}/sim/requests")).json() == {"requests": []}


async def test_fault_switches(start_sim: StartSim, http: httpx.AsyncClient) -> None:
    url = await start_sim(tokens=10, fault="error500")
    body = {"model": "sim-model", "prompt": "x"}
    response = await http.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 500
    assert response.json()["type"] == "InternalServerError"

    assert (await http.post(f"{url}/sim/fault", json={"fault": "bogus"})).status_code == 400
    await http.post(f"{url}/sim/fault", json={"fault": "die_mid_stream"})
    assert (await http.get(f"{url}/sim/fault")).json() == {"fault": "die_mid_stream"}
    lines: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError):
        async with http.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as r:
            lines.extend([line async for line in r.aiter_lines() if line])
    assert "data: [DONE]" not in lines
    assert (await http.post(f"{url}/v1/completions", json=body)).status_code == 200

    await http.post(f"{url}/sim/fault", json={"fault": "hang"})
    with pytest.raises(httpx.ReadTimeout):
        await http.post(f"{url}/v1/completions", json=body, timeout=0.2)

    await http.post(f"{url}/sim/fault", json={"fault": None})
    assert (await http.post(f"{url}/v1/completions", json=body)).status_code == 200


@pytest.mark.parametrize(
    "fields",
    [{"models": ()}, {"max_seqs": 0}, {"itl_ms": -1}, {"tokens": -1}, {"fault": "explode"}],
)
def test_bad_options_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        build_sim_app(SimOptions(**fields))
