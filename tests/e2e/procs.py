"""Real processes on loopback ports: simulated workers and gateways, started and stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.redis_server import free_port

STARTUP_DEADLINE_S = 15.0


@dataclass
class Proc:
    args: list[str]
    port: int
    ready_path: str
    log: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proc:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "gateway", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        # Readiness of another process has no event to wait on: poll, bounded in time.
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while time.monotonic() < deadline:
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.args} exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1.0).status_code < 500:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.args} not ready in {STARTUP_DEADLINE_S}s")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.popen is None or self.popen.poll() is not None:
            return self.popen.returncode if self.popen else 0
        self.popen.send_signal(sig)
        try:
            return self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait(timeout=5)


def sim(tmp: Path, *extra: str, models: tuple[str, ...] = ("m1",)) -> Proc:
    port = free_port()
    args = ["sim", "--port", str(port), "--models", *models, *extra]
    return Proc(args, port, "/health", tmp / f"sim-{port}.log").start()


def gateway(tmp: Path, config_text: str) -> Proc:
    port = free_port()
    config = tmp / f"gateway-{port}.yaml"
    config.write_text(config_text)
    args = ["serve", "--config", str(config), "--port", str(port), "--host", "127.0.0.1"]
    return Proc(args, port, "/healthz", tmp / f"gateway-{port}.log").start()
