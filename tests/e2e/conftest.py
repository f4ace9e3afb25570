"""A small fleet for end-to-end tests: two simulated workers, one slow one, one gateway."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests import conftest as root
from tests.e2e import procs

KEY = "sk-test-acme"
KEY_LIMITED = "sk-test-limited"  # may use m1 only, and never priority
SLASHED = "demo/llama-3-8b"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Fleet:
    gateway: procs.Proc
    fast: list[procs.Proc]
    slow: procs.Proc
    config_path: Path

    @property
    def base_url(self) -> str:
        return self.gateway.url + "/v1"


def fleet_config(fast: list[procs.Proc], slow: procs.Proc) -> str:
    return f"""
redis: {{url: "{root.REDIS_URL}"}}
limits: {{max_body_bytes: 65536}}
models:
  m1:
    tiers: [default, priority, flex]
    serves: [completions, chat, responses]
    endpoints:
      - {{url: "{fast[0].url}", max_concurrency: 4}}
      - {{url: "{fast[1].url}", max_concurrency: 4}}
  m2:
    tiers: [default]
    endpoints:
      - {{url: "{fast[1].url}", max_concurrency: 4, model: m1}}
  slow:
    endpoints:
      - {{url: "{slow.url}", max_concurrency: 2, model: m1}}
  # A token budget (never reached here): what a request reserves shows in its record.
  budgeted:
    serves: [completions, chat, responses]
    endpoints:
      - {{url: "{fast[0].url}", max_concurrency: 4, model: m1, max_tokens_in_flight: 100000}}
  # An embedding model's workers serve nothing else.
  embed:
    serves: [embeddings]
    endpoints:
      - {{url: "{fast[1].url}", max_concurrency: 4, model: m1, max_tokens_in_flight: 100000}}
  misnamed:
    endpoints:
      - {{url: "{fast[0].url}", max_concurrency: 1, model: not-served-here}}
  # A name with a slash, as real ones have (org/model): routes and SDKs must cope.
  {SLASHED}:
    endpoints:
      - {{url: "{fast[0].url}", max_concurrency: 2, model: m1}}
keys:
  - {{sha256: "{digest(KEY)}", account: acme}}
  - {{sha256: "{digest(KEY_LIMITED)}", account: limited, models: [m1], tiers: [flex]}}
"""


# Package scope: its keeper trims the stream `usage`, so it must be gone before the unit
# tests that write ancient stream ids into the same Redis run.
@pytest.fixture(scope="package")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    started: list[procs.Proc] = []
    try:
        fast = [
            procs.sim(tmp, "--ttft-ms", "2", "--itl-ms", "1", "--tokens", "8") for _ in range(2)
        ]
        started += fast
        # Slow enough that a stream is still running when its first chunk arrives.
        slow = procs.sim(tmp, "--ttft-ms", "10", "--itl-ms", "300", "--tokens", "30")
        started.append(slow)
        text = fleet_config(fast, slow)
        gw = procs.gateway(tmp, text)
        started.append(gw)
        yield Fleet(gw, fast, slow, tmp / f"gateway-{gw.port}.yaml")
    finally:
        for proc in started:
            proc.stop()


Sdk = Callable[..., openai.OpenAI]


@pytest.fixture
def sdk() -> Iterator[Sdk]:
    """Makes official openai SDK clients (no retries) and closes them after the test."""
    made: list[openai.OpenAI] = []

    def make(base_url: str, api_key: str = KEY, **options: Any) -> openai.OpenAI:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def keys_create(config: Path, *args: str) -> str:
    """Run `gateway keys create` as an operator would and return the printed key."""
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "keys", "create", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return out.stdout.strip()
