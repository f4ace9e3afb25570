"""What `serve --workers N` costs per request: gateway CPU per request with one process and
with N worker processes, all pinned to the same CPU, so the difference is the price of the
shared metrics files, the supervisor and N sets of background tasks, not of more cores.

Run: .venv/bin/python bench/workers.py [--seconds 5] [--rounds 2] [--workers 2]

It also times one request's metric updates (a counter, two histograms, two token counters)
in a fresh process, with values in memory (one process) and in shared files (workers).

The same set-up as bench/overhead.py: an nginx static upstream, a redis-server of the
benchmark's own, wrk on the other CPU (keep-alive connections, spread by the kernel).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402
from overhead import ANSWER, BODY, KEY  # noqa: E402


def config(redis_url: str, static: int) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
redis: {{url: "{redis_url}", lease_ttl_s: 30}}
models:
  bench: {{endpoints: [{{url: "http://127.0.0.1:{static}", max_concurrency: 4096, model: static}}]}}
keys: [{{sha256: "{digest}", account: bench, max_concurrency: 100000}}]
"""


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its children (the workers), as /proc has them now."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        stat = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(stat[11]) + int(stat[12])) / harness.os.sysconf("SC_CLK_TCK")
        children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        pending += [int(c) for c in children]
    return total


def measure(
    tmp: Path, conf: Path, workers: int, seconds: int, script: Path, connections: int
) -> float:
    """Gateway CPU milliseconds per request at c=`connections` over `seconds`."""
    port = harness.free_port()
    args = ["serve", "--config", str(conf), "--port", str(port), "--host", "127.0.0.1"]
    args += ["--workers", str(workers)]
    gw = harness.start(
        harness.gateway_cli(*args), port, "/healthz", tmp / f"gw-{workers}.log", harness.GATEWAY_CPU
    )
    try:
        harness.wrk(gw.url + "/v1/completions", script, connections, 1)  # every worker up
        before = tree_cpu_seconds(gw.popen.pid)
        result = harness.wrk(gw.url + "/v1/completions", script, connections, seconds)
        spent = tree_cpu_seconds(gw.popen.pid) - before
        assert result.non_2xx == 0, result.raw
        return spent * 1000 / result.requests
    finally:
        gw.stop()


def metric_updates_us(shared: bool) -> float:
    """Microseconds of CPU for one request's metric updates (best of 5 x 100,000)."""
    sys.path.insert(0, str(ROOT))
    from gateway import metrics

    if shared:
        metrics.share_across_processes(tempfile.mkdtemp(prefix="bench-metrics-"))
    m = metrics.Metrics({})

    def one() -> None:
        m.requests.labels("bench", "default", "200").inc()
        m.duration.labels("bench", "default").observe(0.0123)
        m.ttft.labels("bench", "default").observe(0.0051)
        m.tokens.labels("bench", "default", "prompt").inc(1)
        m.tokens.labels("bench", "default", "completion").inc(1)

    best = float("inf")
    for _ in range(5):
        started = time.process_time()
        for _ in range(100_000):
            one()
        best = min(best, (time.process_time() - started) / 100_000)
    return best * 1e6


def micro(mode: str) -> float:
    """`metric_updates_us` in a fresh process pinned to the gateway's CPU."""
    cmd = ["taskset", "-c", harness.GATEWAY_CPU, sys.executable, __file__, "--micro", mode]
    return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--micro", choices=["memory", "shared"], help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--per-worker",
        action="store_true",
        help="16 connections per worker (the same load per process) instead of 16 in all",
    )
    parser.add_argument(
        "--gateway-cpus", default=harness.GATEWAY_CPU, help="taskset list for the gateway"
    )
    args = parser.parse_args()
    if args.micro:
        print(metric_updates_us(args.micro == "shared"))
        return
    harness.GATEWAY_CPU = args.gateway_cpus
    harness.need("wrk", "nginx", "taskset")
    with tempfile.TemporaryDirectory() as name, harness.bench_redis(Path(name)) as redis_url:
        tmp = Path(name)
        nginx, static, _ = harness.nginx(tmp, ANSWER)
        try:
            conf = tmp / "gateway.yaml"
            conf.write_text(config(redis_url, static))
            script = tmp / "post.lua"
            script.write_text(harness.WRK_SCRIPT.format(body=BODY, key=KEY))
            runs: dict[int, list[float]] = {1: [], args.workers: []}
            for _ in range(args.rounds):
                for workers in runs:
                    connections = 16 * workers if args.per_worker else 16
                    runs[workers].append(
                        measure(tmp, conf, workers, args.seconds, script, connections)
                    )
        finally:
            nginx.stop()
    one = statistics.median(runs[1])
    many = statistics.median(runs[args.workers])
    load = "16 connections per worker" if args.per_worker else "c=16"
    print(f"gateway CPU per request, {load}, median of {args.rounds} runs of {args.seconds} s:")
    print(f"  --workers 1: {one:.3f} ms   {runs[1]}")
    print(f"  --workers {args.workers}: {many:.3f} ms   {runs[args.workers]}")
    print(f"  ratio: {many / one:.3f}")
    memory, shared = micro("memory"), micro("shared")
    print(f"one request's metric updates: {memory:.2f} us in memory, {shared:.2f} us shared")


if __name__ == "__main__":
    main()
