"""Processes, pinning, wrk and /proc readings for the benchmarks, and their Redis."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repo's own `tests` package, before any other

from tests.redis_server import RedisServer  # noqa: E402 - no fixtures, just the process

GATEWAY_CPU = "0"
OTHERS_CPU = "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def bench_redis(tmp: Path, given: str | None = None) -> Iterator[str]:
    """The Redis URL a benchmark runs against: `given` (or the environment's REDIS_URL) as
    it is, never flushed, since the benchmark did not start it; else a redis-server of the
    benchmark's own on a free loopback port, empty, stopped at the end."""
    url = given or os.environ.get("REDIS_URL")
    if url:
        print("redis: the given server, not flushed (its gw:* keys and stream `usage` grow)")
        yield url
        return
    server = RedisServer(tmp).start()
    print(f"redis: own redis-server on port {server.port}")
    try:
        yield server.url
    finally:
        server.stop()


def need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: run `make bench` (it installs wrk and nginx)")


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.popen.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")


def start(args: list[str], port: int, ready: str, log: Path, cpu: str) -> Proc:
    with log.open("ab") as out:
        popen = subprocess.Popen(["taskset", "-c", cpu, *args], stdout=out, stderr=out)
    proc = Proc(popen, port)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            sys.exit(f"{args[:4]} exited: {log.read_text()[-1500:]}")
        try:
            if httpx.get(proc.url + ready, timeout=1).status_code < 500:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.stop()
    sys.exit(f"{args[:4]} not ready")


def gateway_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway", *args]


NGINX_CONF = """
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
  keepalive_requests 1000000;
  upstream static {{ server 127.0.0.1:{static}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{static};
    location / {{ default_type application/json; return 200 '{answer}'; }}
    location = /health {{ return 200 'ok'; }}
  }}
  server {{
    listen 127.0.0.1:{proxy};
    location / {{
      proxy_pass http://static;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
}}
"""


def nginx(tmp: Path, answer: str) -> tuple[Proc, int, int]:
    static, proxy = free_port(), free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, static=static, proxy=proxy, answer=answer))
    proc = start(
        ["nginx", "-c", str(conf), "-p", str(tmp)], static, "/health", tmp / "nginx.log", OTHERS_CPU
    )
    return proc, static, proxy


WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
"""

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


@dataclass
class WrkResult:
    rps: float
    requests: int
    p50_ms: float
    p99_ms: float
    non_2xx: int
    raw: str


def wrk(url: str, script: Path, connections: int, seconds: int) -> WrkResult:
    out = subprocess.run(
        ["taskset", "-c", OTHERS_CPU, "wrk", "-t1", f"-c{connections}", f"-d{seconds}s",
         "--latency", "-s", str(script), url],
        capture_output=True, text=True, check=True, timeout=seconds + 30,
    ).stdout  # fmt: skip
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    pct = dict(re.findall(r"^\s+(\d+)%\s+([\d.]+\w+)", out, re.M))
    errors = int(non_2xx.group(1)) if non_2xx else 0
    return WrkResult(rps, total, _ms(pct["50"]), _ms(pct["99"]), errors, out)


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(\w+)", text).groups()  # type: ignore[union-attr]
    return round(float(value) * _UNITS[unit], 3)
