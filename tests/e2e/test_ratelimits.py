"""Rate limits seen from outside: three gateway replicas (separate processes) sharing one
redis-server and one simulated worker. A key's limit holds across them exactly: a burst
spread over the three as fast as it goes gets the bucket's worth, plus only what the bucket
earned back meanwhile (bounded from the burst's own elapsed time), and 429s for the rest;
the headers read through the official openai SDK."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import redis

from routing.store.keys import rate_key
from tests.conftest import REDIS_URL
from tests.e2e import procs
from tests.e2e.conftest import Sdk, digest

KEY_RPM = "sk-rl-rpm"  # 30 requests a minute: one earned back each 2 s
KEY_TPM = "sk-rl-tpm"  # 100 tokens a minute: 10 requests of 10 tokens, one earned back each 6 s
KEY_SDK = "sk-rl-sdk"  # 100 rpm and 10,000 tpm of its own, its account 5,000 tpm
KEY_ONE = "sk-rl-one"  # one request a minute
RPM, TPM = 30, 100
ACCOUNTS = ("e2e-rl-rpm", "e2e-rl-tpm", "e2e-rl-sdk", "e2e-rl-one")
# A prompt of 4 token ids and 6 tokens asked (the worker's natural answer is longer): the
# gateway's estimate and the worker's count agree, so a request costs 10 tokens exactly.
TEN_TOKENS = {"model": "rl", "prompt": [1, 2, 3, 4], "max_tokens": 6}
CONCURRENCY = 16


@dataclass
class Replicas:
    gateways: list[procs.Proc]

    @property
    def urls(self) -> list[str]:
        return [g.url for g in self.gateways]


def config(worker: procs.Proc) -> str:
    return f"""
redis: {{url: "{REDIS_URL}"}}
models:
  # A name of its own: the run's Redis is shared with the other modules' gateways (one of
  # them serves m1 all along), and a model's endpoint index is written by every replica.
  rl:
    endpoints: [{{url: "{worker.url}", max_concurrency: 64, model: m1}}]
keys:
  - {{sha256: "{digest(KEY_RPM)}", account: {ACCOUNTS[0]}, rpm: {RPM}}}
  - {{sha256: "{digest(KEY_TPM)}", account: {ACCOUNTS[1]}, tpm: {TPM}}}
  - {{sha256: "{digest(KEY_SDK)}", account: {ACCOUNTS[2]}, rpm: 100, tpm: 10000}}
  - {{sha256: "{digest(KEY_ONE)}", account: {ACCOUNTS[3]}, rpm: 1}}
accounts:
  {ACCOUNTS[2]}: {{tpm: 5000}}
"""


def forget_buckets() -> None:
    """This module's accounts start full (a run a minute ago may have spent them)."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.delete(*(rate_key(a) for a in ACCOUNTS))
    finally:
        client.close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    tmp = tmp_path_factory.mktemp("ratelimits")
    started: list[procs.Proc] = []
    try:
        worker = procs.sim(
            tmp, "--max-seqs", "64", "--ttft-ms", "0", "--itl-ms", "0", "--tokens", "50"
        )
        started.append(worker)
        text = config(worker)
        gateways = [procs.gateway(tmp, text) for _ in range(3)]
        started += gateways
        forget_buckets()
        yield Replicas(gateways)
    finally:
        for proc in started:
            proc.stop()
        forget_buckets()


async def burst(
    urls: list[str], key: str, count: int, body: dict[str, Any]
) -> tuple[list[httpx.Response], float]:
    """`count` requests of `key`, round robin over `urls`, CONCURRENCY at a time, as fast as
    they go; their answers and the seconds the burst took (its first send to its last answer)."""
    gate = asyncio.Semaphore(CONCURRENCY)
    targets = itertools.cycle(urls)
    headers = {"authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=CONCURRENCY * len(urls))
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def one(url: str) -> httpx.Response:
            async with gate:
                return await client.post(url + "/v1/completions", json=body, headers=headers)

        started = time.monotonic()
        answers = await asyncio.gather(*(one(next(targets)) for _ in range(count)))
        return list(answers), time.monotonic() - started


def check_refusals(answers: list[httpx.Response], code: str) -> None:
    for refused in (a for a in answers if a.status_code == 429):
        assert refused.json()["error"]["code"] == code
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert 1 <= int(refused.headers["retry-after"]) <= 60


async def test_a_burst_over_three_replicas_gets_the_rpm_and_what_refilled(
    replicas: Replicas,
) -> None:
    answers, elapsed_s = await burst(replicas.urls, KEY_RPM, 3 * RPM, TEN_TOKENS)
    statuses = Counter(a.status_code for a in answers)
    assert set(statuses) == {200, 429}, statuses
    # A full bucket's worth at once, then one per emission interval (2 s) of the burst.
    assert RPM <= statuses[200] <= RPM + int(elapsed_s / (60 / RPM))
    check_refusals(answers, "rate_limit_requests")
    served = [a for a in answers if a.status_code == 200]
    left = [int(a.headers["x-ratelimit-remaining-requests"]) for a in served]
    assert 0 in left and min(left) >= 0


async def test_a_burst_over_three_replicas_gets_the_tpm_and_what_refilled(
    replicas: Replicas,
) -> None:
    answers, elapsed_s = await burst(replicas.urls, KEY_TPM, 30, TEN_TOKENS)
    statuses = Counter(a.status_code for a in answers)
    assert set(statuses) == {200, 429}, statuses
    # 10 tokens a request, 100 a minute: 10 at once, one more per 6 s of the burst.
    refilled = int(elapsed_s * TPM / 60)
    assert TPM // 10 <= statuses[200] <= (TPM + refilled) // 10
    check_refusals(answers, "rate_limit_tokens")
    for served in (a for a in answers if a.status_code == 200):
        assert served.json()["usage"]["total_tokens"] == 10  # the charge was exact
        assert "x-ratelimit-limit-requests" not in served.headers


def test_the_sdk_reads_the_headers_of_answers_streams_and_429s(
    replicas: Replicas, sdk: Sdk
) -> None:
    client = sdk(replicas.urls[0] + "/v1", api_key=KEY_SDK)
    raw = client.completions.with_raw_response.create(model="rl", prompt=[1, 2, 3], max_tokens=5)
    assert raw.parse().usage is not None
    headers = raw.headers
    assert headers["x-ratelimit-limit-requests"] == "100"
    assert headers["x-ratelimit-remaining-requests"] == "99"
    assert headers["x-ratelimit-reset-requests"] == "600ms"  # 60 s / 100
    # The account's 5,000 tpm leave fewer tokens than the key's own 10,000.
    assert headers["x-ratelimit-limit-tokens"] == "5000"
    assert headers["x-ratelimit-remaining-tokens"] == "4992"  # 3 prompt + 5 asked
    assert headers["x-ratelimit-reset-tokens"] == "96ms"
    other = sdk(replicas.urls[1] + "/v1", api_key=KEY_SDK)
    with other.completions.with_streaming_response.create(
        model="rl", prompt=[1, 2, 3], max_tokens=5, stream=True
    ) as streamed:
        assert streamed.headers["x-ratelimit-remaining-requests"] == "98"
        assert sum(1 for _ in streamed.iter_lines()) > 0
    one = sdk(replicas.urls[2] + "/v1", api_key=KEY_ONE)
    one.completions.create(model="rl", prompt=[1], max_tokens=1)
    with pytest.raises(openai.RateLimitError) as caught:
        one.completions.create(model="rl", prompt=[1], max_tokens=1)
    refused = caught.value
    assert refused.code == "rate_limit_requests"
    assert 1 <= int(refused.response.headers["retry-after"]) <= 60
    assert refused.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.response.headers["x-ratelimit-reset-requests"].endswith("s")
