"""One real worker and one gateway in front of it, for each kind of server: vLLM's CPU
build and llama.cpp's llama-server, both serving the tests' own tiny model.

`stack` is module-scoped and parametrized by kind, so each server starts once per run
(pytest runs every test of one kind before it starts the other) and only one of them runs
at a time on this 2-core machine. The gateway is the project's own (`gateway serve`, as
tests/e2e starts it) on the run's private redis-server (tests/conftest.py REDIS_URL).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

from tests import conftest as root
from tests.e2e import procs
from tests.realworkers import models, servers
from tests.realworkers.observe import gateway_gauge, poll

KEY = "sk-test-realworkers"
MAX_CONCURRENCY = 2  # the endpoint's, in the gateway's config
WORKER_SEQUENCES = 4  # what the worker itself would run at once: more than the gateway lets


@dataclass(frozen=True)
class Kind:
    """What differs between the two servers, for the tests."""

    name: str
    running: str  # the worker's own gauge of requests running
    generated: str  # the worker's own counter of the tokens it generated
    context: int  # the most tokens a request may have (prompt and answer)
    long_answer: int  # max_tokens of an answer still running when the test acts on it
    load_answer: int  # max_tokens of each request of the load test
    install: servers.Install
    start: Callable[[Path, Path, Path], servers.Server]  # (its install, the model, a folder)


def _vllm(python: Path, model: Path, tmp: Path) -> servers.Server:
    return servers.vllm(
        python, model / "hf", tmp / "vllm.log", max_model_len=256, max_seqs=WORKER_SEQUENCES
    )


def _llama(binary: Path, model: Path, tmp: Path) -> servers.Server:
    return servers.llama(
        binary, model / "model.gguf", tmp / "llama.log", slot_context=4096, slots=WORKER_SEQUENCES
    )


# vLLM on one core makes about 150 tokens a second of this model, llama.cpp some thousands.
KINDS = {
    "vllm": Kind(
        name="vllm",
        running="vllm:num_requests_running",
        generated="vllm:generation_tokens_total",
        context=256,
        long_answer=200,
        load_answer=64,
        install=servers.VLLM,
        start=_vllm,
    ),
    "llama": Kind(
        name="llama",
        running="llamacpp:requests_processing",
        generated="llamacpp:tokens_predicted_total",
        context=4096,
        long_answer=4000,
        load_answer=3000,
        install=servers.LLAMA,
        start=_llama,
    ),
}


@dataclass
class Stack:
    kind: Kind
    worker: servers.Server
    gateway: procs.Proc
    clients: dict[bool, openai.OpenAI] = field(default_factory=dict)

    @property
    def model(self) -> str:
        """The gateway's name of the model (the worker serves it as servers.SERVED)."""
        return f"real-{self.kind.name}"

    def client(self, direct: bool = False) -> openai.OpenAI:
        """The official SDK, without retries: at the gateway, or (`direct`) at the worker."""
        if direct not in self.clients:
            base = (self.worker.url if direct else self.gateway.url) + "/v1"
            self.clients[direct] = openai.OpenAI(
                base_url=base, api_key=KEY, max_retries=0, timeout=120.0
            )
        return self.clients[direct]

    def endpoint_up(self) -> bool:
        up = gateway_gauge(
            self.gateway.url, "gateway_endpoint_up", model=self.model, endpoint=self.worker.url
        )
        return up == 1


def gateway_config(model: str, worker: servers.Server) -> str:
    """Probes every 0.5 s (a killed worker is seen at once anyway: a refused connection
    ejects it), with room for a probe of a worker busy on its one core."""
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
redis: {{url: "{root.REDIS_URL}"}}
health: {{interval_s: 0.5, timeout_s: 10, unhealthy_after: 3}}
models:
  {model}:
    endpoints:
      - {{url: "{worker.url}", model: {servers.SERVED}, max_concurrency: {MAX_CONCURRENCY},
          max_tokens_in_flight: auto}}
keys:
  - {{sha256: "{digest}", account: realworkers}}
"""


@pytest.fixture(scope="module", params=list(KINDS))
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """The server first (a missing one skips, or fails under GATEWAY_CI=1, naming itself),
    then the model (made once, cached), then the worker and the gateway."""
    kind = KINDS[request.param]
    installed = kind.install.need()
    model = models.tiny_model(servers.MODELKIT.need())
    tmp = tmp_path_factory.mktemp(f"real-{kind.name}")
    worker = kind.start(installed, model, tmp)
    gateway: procs.Proc | None = None
    try:
        worker.start()
        gateway = procs.gateway(tmp, gateway_config(f"real-{kind.name}", worker))
        made = Stack(kind, worker, gateway)
        poll("endpoint in the gateway's rotation", made.endpoint_up)
        yield made
        for client in made.clients.values():
            client.close()
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
