"""Live config: a changed file takes effect without a restart or a failed request in flight;
a broken file leaves the running config in force."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import REDIS_URL
from tests.e2e import procs
from tests.e2e.conftest import digest

KEY = "sk-reload"
AUTH = {"Authorization": f"Bearer {KEY}"}


def config(worker: procs.Proc, *, capacity: int, extra_model: bool) -> str:
    def model(name: str, size: int) -> str:
        return f'  {name}: {{endpoints: [{{url: "{worker.url}", max_concurrency: {size}}}]}}\n'

    text = f'redis: {{url: "{REDIS_URL}", lease_ttl_s: 5}}\nmodels:\n' + model("live", capacity)
    if extra_model:
        text += model("added", 2)
    return text + f'keys: [{{sha256: "{digest(KEY)}", account: reload}}]\n'


def wait_for(check: Any, what: str, limit_s: float = 10.0) -> None:
    """Another process's state has no event to wait on: poll it, bounded in time."""
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def models(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(url + "/v1/models", headers=AUTH).json()["data"]}


def fail_fast(url: str, model: str) -> int:
    body = {"model": model, "prompt": "x", "max_tokens": 1, "fail_fast": True}
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=10).status_code


def test_a_changed_config_applies_live_and_a_broken_one_is_refused(tmp_path: Path) -> None:
    timing = ("--ttft-ms", "0", "--itl-ms", "40", "--tokens", "60")
    worker = procs.sim(tmp_path, *timing, models=("live", "added"))
    gateway = procs.gateway(tmp_path, config(worker, capacity=1, extra_model=False))
    path = tmp_path / f"gateway-{gateway.port}.yaml"
    url = gateway.url
    try:
        assert models(url) == {"live"}
        body = {"model": "live", "prompt": "x", "stream": True}
        with httpx.stream(
            "POST", url + "/v1/completions", json=body, headers=AUTH, timeout=30
        ) as held:
            lines = held.iter_lines()
            assert next(lines).startswith("data: ")
            assert fail_fast(url, "live") == 429  # its one slot is taken
            path.write_text(config(worker, capacity=2, extra_model=True))
            wait_for(lambda: models(url) == {"live", "added"}, "the new model")
            assert fail_fast(url, "live") == 200  # the capacity grew under the held stream
            assert fail_fast(url, "added") == 200
            rest = list(lines)
        assert "data: [DONE]" in rest  # the request in flight went through the reload

        path.write_text("models: {live: {endpoints: [{url: 'nope', max_concurrency: -1}]}}\n")
        assert gateway.popen is not None
        gateway.popen.send_signal(signal.SIGHUP)
        log = tmp_path / f"gateway-{gateway.port}.log"
        wait_for(lambda: "config reload refused" in log.read_text(), "the refusal in the log")
        assert models(url) == {"live", "added"}
        assert fail_fast(url, "added") == 200

        path.write_text(config(worker, capacity=1, extra_model=False))
        gateway.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: models(url) == {"live"}, "the removed model to go")
        assert httpx.post(url + "/v1/completions", headers=AUTH,
                          json={"model": "added", "prompt": "x"}).status_code == 404  # fmt: skip
    finally:
        gateway.stop()
        worker.stop()
