"""What the gateway adds: the overhead benchmark (issue "Measured speed", issue 14's targets).

Run: make bench   (or: .venv/bin/python bench/overhead.py [--seconds 8] [--baseline REV])
     .venv/bin/python bench/overhead.py --soak 600   (RSS over ten minutes at c=32)

Redis: a redis-server of the benchmark's own on a free port, unless REDIS_URL names one
(used as it is, never flushed).

One run, one machine: an upstream that costs almost nothing (nginx answering a static
completion), an nginx `proxy_pass` in front of it (the floor for any proxy, a process of its
own), the gateway (real Redis admission on) in front of it too, and with --baseline the
gateway of an earlier revision as well. The gateways are pinned to CPU 0; the nginx hop, the
upstream nginx, wrk, the simulator and the client share CPU 1 (--nginx-cpu 0 moves the hop).
Streams come from the simulator with zero delays, straight and through every hop. The
targets are ratios against the nginx hop and the baseline, measured in the same run.
Results: bench/results/<date>.json (<date>-2.json and on: never overwritten) and a table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import baseline  # noqa: E402
import harness  # noqa: E402
import soak  # noqa: E402
import spy  # noqa: E402
import streams  # noqa: E402
import verdict  # noqa: E402

KEY = "sk-bench-overhead"
ANSWER = json.dumps(
    {
        "id": "cmpl-static", "object": "text_completion", "created": 0, "model": "static",
        "choices": [{"index": 0, "text": " hello", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    },
    separators=(",", ":"),
)  # fmt: skip
PATH = "/v1/completions"
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


@dataclass
class Hop:
    """One target: where its non-stream and stream requests go, the stream's model there,
    and the process whose CPU per request is counted (None: not counted)."""

    name: str
    port: int
    stream_port: int
    stream_model: str
    proc: harness.Proc | None


def main() -> None:
    args = parse_args()
    harness.need("wrk", "nginx", "taskset", "git")
    tmp = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    procs: list[harness.Proc] = []
    redis_cpu = None if args.redis_cpu == "any" else args.redis_cpu
    with harness.bench_redis(tmp, cpu=redis_cpu) as redis_url, contextlib.ExitStack() as stack:
        tree, commit = None, None
        if args.baseline and not args.soak:
            tree, commit = stack.enter_context(baseline.checkout(args.baseline))
            print(f"baseline: {args.baseline} = {commit}, from {tree}")
        try:
            hops = start(tmp, redis_url, procs, tree, args.nginx_cpu)
            script = tmp / "post.lua"
            script.write_text(harness.WRK_SCRIPT.format(body=BODY, key=KEY))
            if args.soak:
                gw = next(hop.proc for hop in hops if hop.name == "gateway" and hop.proc)
                results = soak.soak(gw, script, args.soak, args.soak_every)
            else:
                results = measure(tmp, hops, script, args)
        finally:
            for proc in reversed(procs):
                proc.stop()
    if args.soak:
        write_soak(results, args.out)
    else:
        results["baseline"] = {"rev": args.baseline, "commit": commit}
        results["placement"] = {
            "nginx_hop_cpu": args.nginx_cpu,
            "redis_cpu": args.redis_cpu,
            "stream_client_until_first_byte": "SCHED_FIFO" if streams.prompt_client() else "normal",
            "stream_connections": args.stream_connections,
        }
        report(results, args.out)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=200, help="per target and round")
    parser.add_argument(
        "--stream-connections", choices=streams.CONNECTIONS, default="kept",
        help="each target's streams over one kept-alive connection, or a new one each "
        "(bench/streams.py; default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", metavar="REV",
        help="a git revision whose `gateway serve` runs as a second target (default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--nginx-cpu", default=harness.OTHERS_CPU,
        help="the CPU of the nginx hop (default: the upstream's and wrk's, %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--redis-cpu", default=harness.OTHERS_CPU,
        help="the CPU of the benchmark's own redis-server, or 'any' to let it float (default: "
        "the upstream's and wrk's, %(default)s: in production Redis is another host's)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", type=int, metavar="SECONDS",
        help="after the rounds, a py-spy profile of the gateway at c=32 for that long",
    )  # fmt: skip
    parser.add_argument("--soak", type=int, metavar="SECONDS", help="only the RSS soak at c=32")
    parser.add_argument("--soak-every", type=float, default=10, help="seconds between samples")
    parser.add_argument(
        "--out", type=Path, help="results file (default bench/results/<date>.json, or -2, ...)"
    )
    return parser.parse_args()


def start(
    tmp: Path, redis_url: str, procs: list[harness.Proc], tree: Path | None, nginx_cpu: str
) -> list[Hop]:
    """Start nginx, the simulators and the gateway(s), each added to `procs`; the hops to
    measure: direct, nginx_proxy, gateway and (given a baseline tree) baseline."""
    upstream, static = harness.nginx_static(tmp, ANSWER)
    procs.append(upstream)
    sim = sim_process(tmp, "sim", "--max-seqs", "256", "--itl-ms", "0", "--tokens", "64")
    procs.append(sim)
    full = sim_process(tmp, "full", "--itl-ms", "100", "--tokens", "100000")
    procs.append(full)
    proxy, proxy_port, proxy_stream = harness.nginx_proxy(tmp, static, sim.port, nginx_cpu)
    procs.append(proxy)
    (tmp / "gateway.yaml").write_text(config(redis_url, static, sim.url, full.url))
    hops = [
        Hop("direct", static, sim.port, "m1", upstream),
        Hop("nginx_proxy", proxy_port, proxy_stream, "m1", proxy),
    ]
    for name, checkout in [("gateway", None), ("baseline", tree)][: 2 if tree else 1]:
        gw = gateway_process(tmp, name, checkout)
        procs.append(gw)
        hops.append(Hop(name, gw.port, gw.port, "stream", gw))
    return hops


def sim_process(tmp: Path, name: str, *options: str) -> harness.Proc:
    port = harness.free_port()
    args = harness.gateway_cli(
        "sim", "--port", str(port), "--models", "m1", "--ttft-ms", "0", *options
    )
    return harness.start(args, port, "/health", tmp / f"{name}.log", harness.OTHERS_CPU)


def gateway_process(tmp: Path, name: str, tree: Path | None) -> harness.Proc:
    port = harness.free_port()
    args = harness.gateway_cli(
        "serve", "--config", str(tmp / "gateway.yaml"), "--port", str(port), "--host", "127.0.0.1"
    )
    log = tmp / f"{name}.log"
    return harness.start(args, port, "/healthz", log, harness.GATEWAY_CPU, tree)


def measure(tmp: Path, hops: list[Hop], script: Path, args: Any) -> dict[str, Any]:
    for hop in hops[2:]:
        harness.wrk(url(hop), script, 32, 2)  # warm-up
    # This machine is a VM with neighbours: rounds interleave the targets, medians report.
    c32: dict[str, list[dict[str, float]]] = {hop.name: [] for hop in hops}
    c1: dict[str, list[tuple[float, float]]] = {hop.name: [] for hop in hops}
    timings = {hop.name: streams.Timings() for hop in hops}
    for i in range(args.rounds):
        order = hops if i % 2 == 0 else hops[::-1]  # no target always first or last
        for hop in order:
            c32[hop.name].append(throughput(hop, script, args.seconds))
        for hop in order:
            run = harness.wrk(url(hop), script, 1, max(3, args.seconds // 2))
            c1[hop.name].append((run.p50_ms, run.p99_ms))
        for hop in order:
            time_streams(hop, args.streams, timings[hop.name], args.stream_connections)
    results = summarise(args.rounds, c32, c1)
    results["stream_64_chunks"] = {name: t.summary() for name, t in timings.items()}
    gw = next(hop.proc for hop in hops if hop.name == "gateway" and hop.proc)
    results["fail_fast_429_c1"] = fail_fast(tmp, gw, args.seconds)
    results["gateway_rss_mib"] = round(gw.rss_mib(), 1)
    if args.profile:
        stacks = ROOT / "bench" / "results" / "tmp" / f"profile-{dt.date.today().isoformat()}.txt"
        stacks.parent.mkdir(exist_ok=True)
        results["profile"] = spy.record(gw, script, args.profile, stacks)
    return results


def url(hop: Hop) -> str:
    return f"http://127.0.0.1:{hop.port}{PATH}"


def time_streams(hop: Hop, n: int, into: streams.Timings, connection: str) -> None:
    """n 64-chunk streams from the simulator, through the hop (direct: none)."""
    body = json.dumps({"model": hop.stream_model, "prompt": "x", "stream": True})
    request = streams.request("127.0.0.1", PATH, body.encode(), KEY, connection)
    streams.time_streams("127.0.0.1", hop.stream_port, request, n, into, int(harness.OTHERS_CPU))


def throughput(hop: Hop, script: Path, seconds: int) -> dict[str, float]:
    """One c=32 run: req/s, non-2xx, and the CPU ms per request of the hop's process."""
    cpu_before = hop.proc.cpu_seconds() if hop.proc else 0.0
    run = harness.wrk(url(hop), script, 32, seconds)
    cpu = (hop.proc.cpu_seconds() - cpu_before) * 1000 / max(1, run.requests) if hop.proc else 0.0
    return {"rps": run.rps, "cpu": cpu, "non_2xx": run.non_2xx}


def summarise(
    rounds: int, c32: dict[str, list[dict[str, float]]], c1: dict[str, list[tuple[float, float]]]
) -> dict[str, Any]:
    """Medians over the rounds of each target's c=32 and c=1 figures."""
    results: dict[str, Any] = {"rounds": rounds, "throughput_c32": {}, "latency_c1": {}}
    for name, runs in c32.items():
        results["throughput_c32"][name] = {
            "rps": round(statistics.median(r["rps"] for r in runs)),
            "rps_each": [round(r["rps"]) for r in runs],
            "non_2xx": sum(int(r["non_2xx"]) for r in runs),
            "cpu_ms_per_request": round(statistics.median(r["cpu"] for r in runs), 4),
            "cpu_ms_each": [round(r["cpu"], 4) for r in runs],
        }
        results["latency_c1"][name] = {
            "p50_ms": round(statistics.median(p for p, _ in c1[name]), 3),
            "p99_ms": round(statistics.median(p for _, p in c1[name]), 3),
        }
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
        "added_p99_ms_c1": verdict.added(lat["gateway"]["p99_ms"], lat["direct"]["p99_ms"]),
    }
    for name in tp:
        if name != "direct":
            results["summary"][f"{name}_added_p50_ms_c1"] = verdict.added(
                lat[name]["p50_ms"], lat["direct"]["p50_ms"]
            )
            results["summary"][f"{name}_added_ttfb_ms"] = verdict.added(
                stream[name]["ttfb_p50_ms"], stream["direct"]["ttfb_p50_ms"]
            )
    results["targets"] = verdict.checks(results)
    results["requests_per_cpu_second_vs_baseline"] = verdict.efficiency_vs_baseline(results)
    results["all_targets_met"] = all(
        row["verdict"] == verdict.PASS for row in results["targets"].values()
    )
    results["machine"] = machine()
    out = out or harness.results_path()
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_tables(results)
    print(f"written: {out}")


def machine() -> dict[str, Any]:
    return {
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def print_tables(results: dict[str, Any]) -> None:
    tp, lat = results["throughput_c32"], results["latency_c1"]
    print(f"{'non-stream, c=32':28} {'req/s':>10} {'CPU ms/req':>11}")
    for name, row in tp.items():
        print(f"  {name:26} {row['rps']:>10} {row['cpu_ms_per_request']:>11}")
    print(f"{'non-stream, c=1':28} {'p50 ms':>10} {'p99 ms':>11}")
    for name, row in lat.items():
        print(f"  {name:26} {row['p50_ms']:>10} {row['p99_ms']:>11}")
    print(f"{'64-chunk stream, c=1':28} {'TTFB p50':>10} {'total p50':>11} {'max gap':>8}")
    for name, row in results["stream_64_chunks"].items():
        ttfb, total, gap = row["ttfb_p50_ms"], row["total_p50_ms"], row["widest_gap_p50_ms"]
        print(f"  {name:26} {ttfb:>10} {total:>11} {gap:>8}")
    ff = results["fail_fast_429_c1"]
    print(f"  fail-fast 429 c=1          p50 {ff['p50_ms']} ms  p99 {ff['p99_ms']} ms")
    print(f"  gateway RSS after the run  {results['gateway_rss_mib']} MiB")
    print("summary:", json.dumps(results["summary"]))
    base = results["baseline"]
    print(f"targets (baseline: {base['rev']} = {base['commit']}):" if base["rev"] else "targets:")
    print("\n".join(verdict.check_lines(results["targets"])))
    print("all targets met:", "yes" if results["all_targets_met"] else "no")
    efficiency = results["requests_per_cpu_second_vs_baseline"]
    if efficiency is not None:
        print(f"  cross-check: requests per CPU-second, gateway / baseline: {efficiency}")
    if "profile" in results:
        spy.print_profile(results["profile"])


def write_soak(results: dict[str, Any], out: Path | None) -> None:
    results["machine"] = machine()
    out = out or harness.results_path("soak-")
    out.write_text(json.dumps(results, indent=2) + "\n")
    soak.print_soak(results)
    print(f"written: {out}")


if __name__ == "__main__":
    main()
