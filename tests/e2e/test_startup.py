"""Starting and stopping `gateway serve` and `gateway demo` as an operator does: a busy port
is one line and a non-zero exit, and a stop signal always ends the demo, workers included."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.redis_server import wait_started

BOUND_S = 30.0


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other program listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_demo_on_a_busy_port_is_one_line_and_an_error_exit(busy_port: int) -> None:
    done = run("demo", "--port", str(busy_port))
    assert done.returncode != 0
    assert done.stdout == ""  # no banner, no key: nothing started
    assert done.stderr == f"gateway: port {busy_port} on 127.0.0.1 is in use\n"


def test_serve_on_a_busy_port_is_one_line_before_serving(busy_port: int, tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        'redis: {url: "memory://"}\n'
        "models: {m: {endpoints: [{url: 'http://127.0.0.1:9', max_concurrency: 1}]}}\n"
    )
    done = run("serve", "--config", str(config), "--host", "127.0.0.1", "--port", str(busy_port))
    assert done.returncode != 0
    assert done.stdout == ""
    # Only the line naming the port: no "serving ..." and no traceback.
    assert done.stderr == f"gateway: port {busy_port} on 127.0.0.1 is in use\n"


def refused(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


@contextmanager
def demo_running(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """`gateway demo` on a free port, its banner printed; killed at the end whatever."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "demo.out"
    with out.open("wb") as sink:
        demo = subprocess.Popen(
            [sys.executable, "-m", "gateway", "demo", "--port", str(port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        wait_started(
            demo, lambda: "Ctrl-C stops" in out.read_text(), "gateway demo", out.read_text, 20.0
        )
        yield demo, port, out
    finally:
        demo.kill()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_ends_the_demo_and_its_workers(sig: int, tmp_path: Path) -> None:
    with demo_running(tmp_path) as (demo, port, out):
        found = re.search(r"simulated workers on ports (\d+) and (\d+)", out.read_text())
        assert found is not None
        ports = [port, int(found[1]), int(found[2])]
        assert not any(refused(p) for p in ports)  # all three were serving
        demo.send_signal(sig)
        assert demo.wait(timeout=BOUND_S) == 0
    assert all(refused(p) for p in ports)
    assert "Traceback" not in out.read_text()


def test_a_forced_demo_stop_tells_a_stream_in_flight_the_gateway_stopped(tmp_path: Path) -> None:
    """Ctrl-C twice while a stream runs: the gateway stops first and cuts it short, so its
    caller is told `shutting_down`; the workers, stopped with it, broke the stream under it
    first as often as not (`upstream_stream_broken`)."""
    with demo_running(tmp_path) as (demo, port, out):
        found = re.search(r"demo key: (\S+)", out.read_text())
        assert found is not None
        body = {"model": "demo/llama-3-8b", "prompt": "x", "stream": True}
        headers = {"authorization": f"Bearer {found[1]}"}
        url = f"http://127.0.0.1:{port}/v1/completions"
        with httpx.stream("POST", url, json=body, headers=headers, timeout=BOUND_S) as answer:
            lines = answer.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            demo.send_signal(signal.SIGINT)
            # Taken (no event crosses the process: polled): the gateway stopped accepting.
            wait_started(demo, lambda: refused(port), "the first stop", out.read_text, 10.0)
            demo.send_signal(signal.SIGINT)
            rest = list(lines)
        assert demo.wait(timeout=BOUND_S) == 0
    assert answer.status_code == 200 and "[DONE]" not in first
    events = [line for line in rest if line.startswith("data: ")]
    assert events and '"shutting_down"' in events[-1], rest
    assert "Traceback" not in out.read_text()
