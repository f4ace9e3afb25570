"""The simulated worker's KV cache (`gateway sim --kv-tokens`): a request runs while the
running requests' prompts and answers fit the cache, else waits first come first served and
counts in `vllm:num_requests_waiting`, as vLLM's scheduler does; the cache's shape in
`vllm:cache_config_info`, its use in `vllm:kv_cache_usage_perc`, its peak in /sim/peak."""

from __future__ import annotations

import asyncio

import httpx

from gateway.sim.load import Slots
from tests.gateway.sim.test_sim import StartSim, http, metric, start_sim, wait_metric

__all__ = ["http", "start_sim"]  # the fixtures, used by name


async def test_a_request_waits_while_the_cache_cannot_hold_it_though_a_slot_is_free() -> None:
    slots = Slots(8, budget=100)
    await slots.acquire(60)
    later = asyncio.create_task(slots.acquire(50))
    await asyncio.sleep(0)
    assert (slots.running, slots.waiting, slots.tokens) == (1, 1, 60)
    slots.release(60)
    await asyncio.wait_for(later, 1)
    assert (slots.running, slots.waiting, slots.tokens) == (1, 0, 50)
    assert slots.peak_tokens == 60 and slots.take_window()[3] == 60


async def test_the_head_of_the_line_holds_back_smaller_ones_behind_it() -> None:
    slots = Slots(8, budget=100)
    await slots.acquire(60)
    big = asyncio.create_task(slots.acquire(50))
    small = asyncio.create_task(slots.acquire(10))  # would fit, but came later
    await asyncio.sleep(0)
    assert slots.waiting == 2 and slots.tokens == 60
    big.cancel()  # the head leaves: the one behind it fits now
    await asyncio.gather(big, return_exceptions=True)
    await asyncio.wait_for(small, 1)
    assert (slots.running, slots.tokens, slots.waiting) == (2, 70, 0)
    assert not slots.fits_ever(101) and slots.fits_ever(100)


async def test_the_cache_is_reported_as_vllm_does_and_a_request_it_cannot_hold_is_400(
    start_sim: StartSim, http: httpx.AsyncClient
) -> None:
    url = await start_sim(max_seqs=4, kv_tokens=22, block_size=4, ttft_ms=50, tokens=8)
    info = await metric(http, url, "vllm:cache_config_info", block_size="4", num_gpu_blocks="5")
    assert info == 1
    body = {"model": "sim-model", "prompt": "hello there", "max_tokens": 8}
    one = (await http.post(f"{url}/v1/completions", json=body)).json()["usage"]
    need = one["prompt_tokens"] + one["completion_tokens"]
    assert need == 10  # "hello there" and 8 tokens: the cache (5 blocks of 4) holds two
    three = [asyncio.create_task(http.post(f"{url}/v1/completions", json=body)) for _ in range(3)]
    await wait_metric(http, url, "vllm:num_requests_waiting", 1, model_name="sim-model")
    usage = await metric(http, url, "vllm:kv_cache_usage_perc", model_name="sim-model")
    assert usage == 2 * need / 20
    assert all(a.status_code == 200 for a in await asyncio.gather(*three))
    peak = (await http.get(f"{url}/sim/peak")).json()
    assert (peak["peak_tokens"], peak["kv_budget"], peak["peak_running"]) == (2 * need, 20, 2)
    huge = {"model": "sim-model", "prompt": "word " * 100, "max_tokens": 8}
    refused = await http.post(f"{url}/v1/completions", json=huge)
    assert refused.status_code == 400 and "KV cache" in refused.json()["message"]
