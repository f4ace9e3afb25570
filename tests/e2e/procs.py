"""Real processes on loopback ports: simulated workers and gateways, started and stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.redis_server import free_port, wait_started


@dataclass
class Proc:
    args: list[str]
    port: int
    ready_path: str
    log: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    # A process group of its own (a terminal's, as it were): `signal_group` reaches all of it.
    group: bool = False

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
                start_new_session=self.group,
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.popen is not None
        log_tail = lambda: self.log.read_text()[-2000:]  # noqa: E731
        # A Python process on a busy 2-core machine starts slower than redis-server.
        wait_started(self.popen, self._answers, str(self.args), log_tail, deadline_s=15.0)

    def _answers(self) -> bool:
        try:
            return httpx.get(self.url + self.ready_path, timeout=1.0).status_code < 500
        except httpx.TransportError:
            return False

    def signal_group(self, sig: int) -> None:
        """`sig` to every process of its group, as a terminal's Ctrl-C sends SIGINT."""
        assert self.group and self.popen is not None
        os.killpg(self.popen.pid, sig)

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


def gateway(tmp: Path, config_text: str, *extra: str, group: bool = False) -> Proc:
    port = free_port()
    config = tmp / f"gateway-{port}.yaml"
    config.write_text(config_text)
    args = ["serve", "--config", str(config), "--port", str(port), "--host", "127.0.0.1", *extra]
    return Proc(args, port, "/healthz", tmp / f"gateway-{port}.log", group=group).start()
