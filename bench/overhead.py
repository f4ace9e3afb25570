"""What the gateway adds: the overhead benchmark (issue "Measured speed").

Run: make bench   (or: .venv/bin/python bench/overhead.py [--seconds 8])

Redis: a redis-server of the benchmark's own on a free port, unless REDIS_URL names one
(used as it is, never flushed).

One run, one machine: an upstream that costs almost nothing (nginx answering a static
completion), an nginx `proxy_pass` in front of it (the floor for any proxy), and the gateway
(real Redis admission on) in front of it too. The gateway is pinned to CPU 0; nginx, wrk, the
simulator and the client share CPU 1. Streams come from the simulator with zero delays.
Results: bench/results/<date>.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402

KEY = "sk-bench-overhead"
ANSWER = json.dumps(
    {
        "id": "cmpl-static", "object": "text_completion", "created": 0, "model": "static",
        "choices": [{"index": 0, "text": " hello", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    },
    separators=(",", ":"),
)  # fmt: skip
BODY = '{"model": "bench", "prompt": "hello", "max_tokens": 1}'


def config(redis_url: str, static: int, sim: str, full: str) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
redis: {{url: "{redis_url}", lease_ttl_s: 30}}
models:
  bench: {{endpoints: [{{url: "http://127.0.0.1:{static}", max_concurrency: 4096, model: static}}]}}
  stream: {{endpoints: [{{url: "{sim}", max_concurrency: 256, model: m1}}]}}
  full: {{endpoints: [{{url: "{full}", max_concurrency: 1, model: m1}}]}}
keys: [{{sha256: "{digest}", account: bench, max_concurrency: 100000}}]
"""


async def stream_timings(host: str, port: int, path: str, body: bytes, n: int) -> dict[str, float]:
    """TTFB (first `data:` byte) and total time of n sequential streams, new connection each."""
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    firsts, totals, gaps = [], [], []
    for i in range(n + 20):
        start = time.perf_counter()
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request)
        first = None
        last = start
        widest = 0.0
        data = b""
        while chunk := await reader.read(65536):
            now = time.perf_counter()
            data += chunk
            if first is None and b"data:" in data:
                first = now
            elif first is not None:
                widest = max(widest, now - last)
            last = now
        writer.close()
        if b"[DONE]" not in data:
            raise RuntimeError(f"stream did not finish: {data[-300:]!r}")
        if i >= 20:  # warm-up excluded
            firsts.append((first or last) - start)
            totals.append(last - start)
            gaps.append(widest)
    return {
        "ttfb_p50_ms": round(statistics.median(firsts) * 1000, 3),
        "total_p50_ms": round(statistics.median(totals) * 1000, 3),
        "widest_gap_p50_ms": round(statistics.median(gaps) * 1000, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--out", type=Path, help="results file (default bench/results/<date>.json)")
    args = parser.parse_args()
    harness.need("wrk", "nginx", "taskset")
    tmp = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    procs: list[harness.Proc] = []
    with harness.bench_redis(tmp) as redis_url:
        try:
            results = run(tmp, redis_url, procs, args)
        finally:
            for proc in reversed(procs):
                proc.stop()
    report(results, args.out)


def run(tmp: Path, redis_url: str, procs: list[harness.Proc], args: Any) -> dict[str, Any]:
    """Start nginx, the simulators and the gateway (each added to `procs`), then measure."""
    ngx, static, proxy = harness.nginx(tmp, ANSWER)
    procs.append(ngx)
    sim_port, full_port = harness.free_port(), harness.free_port()
    sim = harness.start(
        harness.gateway_cli("sim", "--port", str(sim_port), "--models", "m1", "--max-seqs",
                            "256", "--ttft-ms", "0", "--itl-ms", "0", "--tokens", "64"),
        sim_port, "/health", tmp / "sim.log", harness.OTHERS_CPU,
    )  # fmt: skip
    procs.append(sim)
    full = harness.start(
        harness.gateway_cli("sim", "--port", str(full_port), "--models", "m1",
                            "--ttft-ms", "0", "--itl-ms", "100", "--tokens", "100000"),
        full_port, "/health", tmp / "full.log", harness.OTHERS_CPU,
    )  # fmt: skip
    procs.append(full)
    gw_port = harness.free_port()
    (tmp / "gateway.yaml").write_text(config(redis_url, static, sim.url, full.url))
    gw = harness.start(
        harness.gateway_cli("serve", "--config", str(tmp / "gateway.yaml"), "--port",
                            str(gw_port), "--host", "127.0.0.1"),
        gw_port, "/healthz", tmp / "gateway.log", harness.GATEWAY_CPU,
    )  # fmt: skip
    procs.append(gw)
    return measure(tmp, static, proxy, gw, sim, args)


def measure(
    tmp: Path, static: int, proxy: int, gw: harness.Proc, sim: harness.Proc, args: Any
) -> dict[str, Any]:
    script = tmp / "post.lua"
    script.write_text(harness.WRK_SCRIPT.format(body=BODY, key=KEY))
    targets = {
        "direct": f"http://127.0.0.1:{static}/v1/completions",
        "nginx_proxy": f"http://127.0.0.1:{proxy}/v1/completions",
        "gateway": gw.url + "/v1/completions",
    }
    harness.wrk(targets["gateway"], script, 32, 2)  # warm-up
    # This machine is a VM with neighbours: rounds interleave the targets, medians report.
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    latency: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
    for _ in range(args.rounds):
        for name, url in targets.items():
            cpu_before = gw.cpu_seconds()
            run = harness.wrk(url, script, 32, args.seconds)
            cpu = (gw.cpu_seconds() - cpu_before) * 1000 / max(1, run.requests)
            rounds[name].append({"rps": run.rps, "cpu": cpu, "non_2xx": run.non_2xx})
        for name, url in targets.items():
            run = harness.wrk(url, script, 1, max(3, args.seconds // 2))
            latency[name].append((run.p50_ms, run.p99_ms))
    results: dict[str, Any] = {"rounds": args.rounds, "throughput_c32": {}, "latency_c1": {}}
    for name in targets:
        row: dict[str, Any] = {
            "rps": round(statistics.median(r["rps"] for r in rounds[name])),
            "rps_each": [round(r["rps"]) for r in rounds[name]],
            "non_2xx": sum(int(r["non_2xx"]) for r in rounds[name]),
        }
        if name == "gateway":
            row["cpu_ms_per_request"] = round(statistics.median(r["cpu"] for r in rounds[name]), 3)
        results["throughput_c32"][name] = row
        results["latency_c1"][name] = {
            "p50_ms": round(statistics.median(p for p, _ in latency[name]), 3),
            "p99_ms": round(statistics.median(p for _, p in latency[name]), 3),
        }
    stream_body = json.dumps({"model": "m1", "prompt": "x", "stream": True}).encode()
    gw_body = json.dumps({"model": "stream", "prompt": "x", "stream": True}).encode()
    path, n = "/v1/completions", args.streams
    results["stream_64_chunks"] = {
        "direct": asyncio.run(stream_timings("127.0.0.1", sim.port, path, stream_body, n)),
        "gateway": asyncio.run(stream_timings("127.0.0.1", gw.port, path, gw_body, n)),
    }
    results["fail_fast_429_c1"] = fail_fast(tmp, gw, args.seconds)
    results["gateway_rss_mib"] = round(gw.rss_mib(), 1)
    return results


def fail_fast(tmp: Path, gw: harness.Proc, seconds: int) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {KEY}"}
    hold = {"model": "full", "prompt": "x", "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", gw.url + "/v1/completions", json=hold, headers=headers) as held,
    ):
        chunks = held.iter_bytes()  # keep a reference: a collected iterator closes the stream
        next(chunks)
        script = tmp / "busy.lua"
        body = '{"model": "full", "prompt": "x", "fail_fast": true}'
        script.write_text(harness.WRK_SCRIPT.format(body=body, key=KEY))
        run = harness.wrk(gw.url + "/v1/completions", script, 1, max(3, seconds // 2))
    if run.non_2xx != run.requests:
        raise RuntimeError(f"expected only 429s, got {run.requests - run.non_2xx} answers")
    return {"p50_ms": run.p50_ms, "p99_ms": run.p99_ms}


def report(results: dict[str, Any], out: Path | None) -> None:
    tp, lat = results["throughput_c32"], results["latency_c1"]
    stream = results["stream_64_chunks"]
    results["summary"] = {
        "rps_ratio_gateway_to_direct": round(tp["gateway"]["rps"] / tp["direct"]["rps"], 3),
        "added_p50_ms_c1": round(lat["gateway"]["p50_ms"] - lat["direct"]["p50_ms"], 3),
        "added_p99_ms_c1": round(lat["gateway"]["p99_ms"] - lat["direct"]["p99_ms"], 3),
        "nginx_added_p50_ms_c1": round(lat["nginx_proxy"]["p50_ms"] - lat["direct"]["p50_ms"], 3),
        "stream_added_ttfb_ms": round(
            stream["gateway"]["ttfb_p50_ms"] - stream["direct"]["ttfb_p50_ms"], 3
        ),
    }  # fmt: skip
    results["machine"] = {
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    out = out or ROOT / "bench" / "results" / f"{dt.date.today().isoformat()}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'non-stream, c=32':28} {'req/s':>10} {'CPU ms/req':>11}")
    for name, row in tp.items():
        print(f"  {name:26} {row['rps']:>10} {row.get('cpu_ms_per_request', ''):>11}")
    print(f"{'non-stream, c=1':28} {'p50 ms':>10} {'p99 ms':>11}")
    for name, row in lat.items():
        print(f"  {name:26} {row['p50_ms']:>10} {row['p99_ms']:>11}")
    print(f"{'64-chunk stream, c=1':28} {'TTFB p50':>10} {'total p50':>11} {'max gap':>8}")
    for name, row in stream.items():
        ttfb, total, gap = row["ttfb_p50_ms"], row["total_p50_ms"], row["widest_gap_p50_ms"]
        print(f"  {name:26} {ttfb:>10} {total:>11} {gap:>8}")
    ff = results["fail_fast_429_c1"]
    print(f"  fail-fast 429 c=1          p50 {ff['p50_ms']} ms  p99 {ff['p99_ms']} ms")
    print(f"  gateway RSS after the run  {results['gateway_rss_mib']} MiB")
    print("summary:", json.dumps(results["summary"]))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
