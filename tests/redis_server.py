"""A private redis-server for the tests: started on a free loopback port, never shared.

Every test run starts its own (two runs on one machine never meet), and fault tests start
more of them to kill, restart empty, or stall (SIGSTOP) at will. Nothing is kept on disk
unless `persistent` asks for an append-only file, like a production Redis would. Tests of
misconfigured stores give it more: extra arguments (`--requirepass`, `--replicaof`), TLS
only (a certificate and key, e.g. `self_signed`), or Sentinel mode.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

STARTUP_DEADLINE_S = 10.0

# redis-py types a reply for either `decode_responses`; what a client of the tests gets
# (bytes; text where a client asks `decode_responses=True`), for `cast`.
StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]
TextStreamEntries = list[tuple[str, dict[str, str]]]
ScoredMembers = list[tuple[bytes, float]]


def endpoint_load(fields: Mapping[Any, Any]) -> int:
    """Leases counted on a model's endpoints, from its `ep_load` hash (HGETALL): the fields
    of its flags (`~s`, `~f`: state, frees) left out."""
    return sum(int(v) for k, v in fields.items() if not _text(k).startswith("~"))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "the tests need redis-server (Debian: apt-get install redis-server); "
            "they start their own on a free port"
        )
    return found


def wait_started(
    popen: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    what: str,
    log_tail: Callable[[], str],
    deadline_s: float = STARTUP_DEADLINE_S,
) -> None:
    """Until another process answers `ready`; there is no event to wait on across
    processes, so this polls, bounded in time, and fails at once if the process exits."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"{what} exited: {log_tail()}")
        if ready():
            return
        time.sleep(0.02)
    raise RuntimeError(f"{what} did not start in {deadline_s}s")


def _pong(conn: socket.socket) -> bool:
    conn.sendall(b"PING\r\n")
    return conn.recv(16).startswith((b"+PONG", b"-NOAUTH"))


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made by the `openssl` binary."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


class RedisServer:
    """One redis-server process on 127.0.0.1:<port>, with its files under `directory`.
    `tls`: (certificate, key) to serve TLS only on that port; `sentinel`: run as a Sentinel
    (watching `monitor`, a port where no master need answer)."""

    def __init__(
        self,
        directory: Path,
        *,
        persistent: bool = False,
        maxmemory: str | None = None,
        port: int | None = None,
        extra: Sequence[str] = (),
        tls: tuple[Path, Path] | None = None,
        sentinel: bool = False,
        monitor: int = 1,
    ) -> None:
        self.port = port or free_port()
        self.dir = directory / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.persistent = persistent
        self.maxmemory = maxmemory
        self.extra = list(extra)
        self.tls = tls
        self.sentinel = sentinel
        self.monitor = monitor
        self.popen: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls is not None else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        if self.sentinel:
            return self._sentinel_args()
        port = (
            ["--port", "0", "--tls-port", str(self.port)]
            if self.tls
            else ["--port", str(self.port)]
        )
        args = [redis_server_binary(), *port, "--bind", "127.0.0.1",
                "--save", "", "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log"),
                "--appendonly", "yes" if self.persistent else "no"]  # fmt: skip
        if self.persistent:
            # The tests kill the process, never the host: Redis write(2)s the AOF before any
            # reply goes out, whatever the fsync policy, and the kernel keeps what a killed
            # process wrote. An fsync per write (`always`) only put the disk's latency into
            # every call: on a busy shared disk one fsync can take longer than the gateway's
            # command timeout, a stall no fault test injected (and so misjudged as an outage
            # while "Redis was well").
            args += ["--appendfsync", "no"]
        if self.maxmemory is not None:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        if self.tls is not None:
            args += ["--tls-cert-file", str(self.tls[0]), "--tls-key-file", str(self.tls[1]),
                     "--tls-auth-clients", "no"]  # fmt: skip
        return args + self.extra

    def _sentinel_args(self) -> list[str]:
        conf = self.dir / "sentinel.conf"  # Sentinel rewrites its config file: one of its own
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"logfile {self.dir / 'redis.log'}\n"
            f"sentinel monitor gw 127.0.0.1 {self.monitor} 1\n"
        )
        return [redis_server_binary(), str(conf), "--sentinel", *self.extra]

    def start(self) -> RedisServer:
        self.popen = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL)
        self.paused = False
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.popen is not None
        wait_started(self.popen, self.ping, "redis-server", self.log_tail)

    def ping(self, timeout_s: float = 0.5) -> bool:
        """Whether the server answers (a PONG, or a refusal for want of a password)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s) as s:
                if self.tls is None:
                    return _pong(s)
                context = ssl.create_default_context()
                context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
                with context.wrap_socket(s) as tls:
                    return _pong(tls)
        except OSError:
            return False

    def log_tail(self) -> str:
        log = self.dir / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """kill -9: whatever it held in memory is gone (and, without AOF, everything)."""
        if self.popen is None:
            return
        if self.paused:
            self.resume()
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)

    def restart_empty(self) -> None:
        """kill -9, then start again on the same port with nothing in it."""
        self.kill()
        if not self.persistent:
            for leftover in self.dir.glob("*.rdb"):
                leftover.unlink()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections open and answers nothing."""
        assert self.popen is not None
        os.kill(self.popen.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.popen is not None
        os.kill(self.popen.pid, signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            if self.paused:
                self.resume()
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
