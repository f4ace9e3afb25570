"""A gateway process's log output: quiet by default, one JSON object per line with
`--log-format json`, one line per request with `--access-log`, never a key or a prompt."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.e2e import procs

KEY = "sk-log-test-7f3a9c"
PROMPT = "tell me about the purple walrus 4711"
PROBES = 3  # health probes seen before the output is read
BOUND_S = 15.0


class Probed:
    """A stand-in endpoint that only answers health probes, counting them."""

    def __init__(self) -> None:
        self.count = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.count += 1
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def wait_for_probes(self, n: int) -> None:
        start, deadline = self.count, time.monotonic() + BOUND_S
        while self.count < start + n:
            assert time.monotonic() < deadline, "the gateway never probed its endpoints"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[procs.Proc, Probed]]:
    tmp = tmp_path_factory.mktemp("logs")
    sim = procs.sim(tmp, "--ttft-ms", "1", "--itl-ms", "1", "--tokens", "4")
    probed = Probed()
    try:
        yield sim, probed
    finally:
        probed.close()
        sim.stop()


def config(sim: procs.Proc, probed: Probed) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
redis: {{url: "memory://"}}
health: {{interval_s: 0.05}}
models:
  m1:
    tiers: [default, flex]
    endpoints: [{{url: "{sim.url}", max_concurrency: 2}}]
  probed:
    endpoints: [{{url: "{probed.url}", max_concurrency: 1}}]
keys:
  - {{sha256: "{digest}", account: acme}}
"""


def traffic(gateway: procs.Proc) -> None:
    """A completion, a stream, a refused key and a refused body, each carrying the prompt."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
    messages: Any = [{"role": "user", "content": PROMPT}]
    with client:
        client.chat.completions.create(
            model="m1",
            messages=messages,
            service_tier="flex",
            extra_headers={"x-request-id": "log-test-chat"},
        )
        list(client.completions.create(model="m1", prompt=PROMPT, max_tokens=3, stream=True))
    refusing = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY + "x", max_retries=0)
    with refusing, pytest.raises(openai.AuthenticationError):
        refusing.models.list()
    refused = httpx.post(
        gateway.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": "m1", "messages": [{"role": "user", "content": PROMPT}], "n": "many"},
    )
    assert refused.status_code == 422


def run_gateway(
    tmp_path: Path, workers: tuple[procs.Proc, Probed], *options: str
) -> tuple[str, int]:
    """Start a gateway, send `traffic`, wait for probes, stop it: its output and exit code."""
    sim, probed = workers
    gateway = procs.gateway(tmp_path, config(sim, probed), *options)
    try:
        traffic(gateway)
        probed.wait_for_probes(PROBES)
    finally:
        code = gateway.stop()
    return gateway.log.read_text(), code


def test_json_access_log(tmp_path: Path, workers: tuple[procs.Proc, Probed]) -> None:
    output, code = run_gateway(tmp_path, workers, "--log-format", "json", "--access-log")
    assert code == 0
    lines = [orjson.loads(line) for line in output.splitlines()]  # each line is JSON
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    access = [line for line in lines if line["logger"] == "gateway.access"]
    [chat] = [line for line in access if line["request_id"] == "log-test-chat"]
    assert chat["method"] == "POST"
    assert chat["path"] == "/v1/chat/completions"
    assert (chat["model"], chat["tier"], chat["status"]) == ("m1", "flex", 200)
    for duration in ("duration_ms", "queue_ms", "ttft_ms"):
        assert isinstance(chat[duration], float) and chat[duration] >= 0, duration
    by_status = {(line["path"], line["status"]) for line in access}
    assert ("/v1/completions", 200) in by_status  # the stream
    assert ("/v1/models", 401) in by_status
    assert ("/v1/chat/completions", 422) in by_status
    assert not any(line["path"] == "/health" for line in access)  # probes are not requests
    # Never a key or a prompt, anywhere in the output.
    assert KEY not in output
    assert "purple walrus" not in output


def test_default_output_is_quiet(tmp_path: Path, workers: tuple[procs.Proc, Probed]) -> None:
    output, code = run_gateway(tmp_path, workers)
    assert code == 0
    assert "/health" not in output  # no line per health probe
    assert "gateway.access" not in output and "/v1/" not in output  # nor per request
    lines = output.splitlines()
    assert any("serving 2 models" in line for line in lines)
    assert len(lines) <= 3, output  # serving, stopping: the events that matter
    assert KEY not in output and "purple walrus" not in output
