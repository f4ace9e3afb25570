"""Processes, pinning, wrk and /proc readings for the benchmarks, and their Redis."""

from __future__ import annotations

import datetime as dt
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
def bench_redis(tmp: Path, given: str | None = None, cpu: str | None = None) -> Iterator[str]:
    """The Redis URL a benchmark runs against: `given` (or the environment's REDIS_URL) as
    it is, never flushed, since the benchmark did not start it; else a redis-server of the
    benchmark's own on a free loopback port, empty, stopped at the end, pinned to `cpu`
    (a CPU number; None: wherever the scheduler puts it)."""
    url = given or os.environ.get("REDIS_URL")
    if url:
        print("redis: the given server, not flushed (its gw:* keys and stream `usage` grow)")
        yield url
        return
    server = RedisServer(tmp).start()
    if cpu is not None:
        os.sched_setaffinity(server.popen.pid, {int(cpu)})
    where = "floating" if cpu is None else f"pinned to CPU {cpu}"
    print(f"redis: own redis-server on port {server.port}, {where}")
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
        """utime + stime of the process and every live descendant (nginx's workers, the
        processes of `serve --workers N`)."""
        return sum(_stat(pid)[0] for pid in tree(self.popen.pid))

    def rss_mib(self) -> float:
        """Resident memory of the process and every live descendant."""
        return sum(_stat(pid)[1] for pid in tree(self.popen.pid)) / 2**20


def tree(root: int) -> list[int]:
    """`root` and its live descendants, from /proc/<pid>/stat's ppid."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            parents[int(entry.name)] = int(fields[1])
    found, todo = [root], [root]
    while todo:
        parent = todo.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        todo += children
    return found


def _stat(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of one process; zeros if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return cpu, int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # rss in pages


def start(
    args: list[str], port: int, ready: str, log: Path, cpu: str, tree_dir: Path | None = None
) -> Proc:
    """Start `args` pinned to `cpu` and wait until `ready` answers. `tree_dir`: run it from
    that checkout (cwd and PYTHONPATH), not from this one."""
    env = dict(os.environ, PYTHONPATH=str(tree_dir)) if tree_dir else None
    with log.open("ab") as out:
        popen = subprocess.Popen(
            ["taskset", "-c", cpu, *args], stdout=out, stderr=out, env=env, cwd=tree_dir
        )
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


NGINX_MAIN = """
worker_processes 1;
daemon off;
pid {tmp}/nginx-{name}.pid;
error_log {tmp}/nginx-{name}-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body-{name};
  proxy_temp_path {tmp}/proxy-{name};
  fastcgi_temp_path {tmp}/fastcgi-{name};
  uwsgi_temp_path {tmp}/uwsgi-{name};
  scgi_temp_path {tmp}/scgi-{name};
  keepalive_requests 1000000;
  server {{
    listen 127.0.0.1:{health};
    location = /health {{ return 200 'ok'; }}
  }}
{servers}
}}
"""

STATIC = """
  server {{
    listen 127.0.0.1:{static};
    location / {{ default_type application/json; return 200 '{answer}'; }}
  }}
"""

# The floor for any proxy: the same hop as the gateway's (keep-alive to the upstream), and
# for streams, every byte passed on as it comes (proxy_buffering off).
PROXY = """
  upstream static {{ server 127.0.0.1:{static}; keepalive 64; }}
  upstream sim {{ server 127.0.0.1:{sim}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{proxy};
    location / {{
      proxy_pass http://static;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
  server {{
    listen 127.0.0.1:{stream};
    location / {{
      proxy_pass http://sim;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
"""


def _nginx(tmp: Path, name: str, servers: str, cpu: str) -> Proc:
    health = free_port()
    conf = tmp / f"nginx-{name}.conf"
    conf.write_text(NGINX_MAIN.format(tmp=tmp, name=name, health=health, servers=servers))
    args = ["nginx", "-c", str(conf), "-p", str(tmp)]
    return start(args, health, "/health", tmp / f"nginx-{name}.log", cpu)


def nginx_static(tmp: Path, answer: str) -> tuple[Proc, int]:
    """nginx answering a static completion on every path (the upstream that costs almost
    nothing), on the others' CPU; its port."""
    static = free_port()
    servers = STATIC.format(static=static, answer=answer)
    return _nginx(tmp, "static", servers, OTHERS_CPU), static


def nginx_proxy(tmp: Path, static: int, sim: int, cpu: str = GATEWAY_CPU) -> tuple[Proc, int, int]:
    """nginx `proxy_pass` to the static upstream and to the simulator, a process of its own
    (its CPU its own), by default pinned to the gateway's CPU (the hop placed like the
    gateway); its non-stream and stream ports."""
    proxy, stream = free_port(), free_port()
    servers = PROXY.format(static=static, sim=sim, proxy=proxy, stream=stream)
    return _nginx(tmp, "proxy", servers, cpu), proxy, stream


def results_path(prefix: str = "") -> Path:
    """bench/results/<prefix><today>.json, or the first of -2, -3, ... not yet there: a run
    never overwrites the day's earlier results (committed ones among them)."""
    base = ROOT / "bench" / "results" / f"{prefix}{dt.date.today().isoformat()}"
    path, n = base.with_suffix(".json"), 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}.json")
    return path


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


def wrk_args(url: str, script: Path, connections: int, seconds: int) -> list[str]:
    return ["taskset", "-c", OTHERS_CPU, "wrk", "-t1", f"-c{connections}", f"-d{seconds}s",
            "--latency", "-s", str(script), url]  # fmt: skip


def wrk(url: str, script: Path, connections: int, seconds: int) -> WrkResult:
    out = subprocess.run(
        wrk_args(url, script, connections, seconds),
        capture_output=True, text=True, check=True, timeout=seconds + 30,
    ).stdout  # fmt: skip
    return parse_wrk(out)


def parse_wrk(out: str) -> WrkResult:
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    pct = dict(re.findall(r"^\s+(\d+)%\s+([\d.]+\w+)", out, re.M))
    errors = int(non_2xx.group(1)) if non_2xx else 0
    return WrkResult(rps, total, _ms(pct["50"]), _ms(pct["99"]), errors, out)


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(\w+)", text).groups()  # type: ignore[union-attr]
    return round(float(value) * _UNITS[unit], 3)
