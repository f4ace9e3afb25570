"""Two or more builds of the gateway, interleaved: CPU per request at c=32, req/s, p50 at c=1.

Run: .venv/bin/python bench/ab.py REV [REV ...]      (`.` is this checkout as it is)
     .venv/bin/python bench/ab.py HEAD~1 . --rounds 4 --seconds 4

The overhead benchmark's set-up (bench/overhead.py: nginx answering a static completion,
the benchmark's own Redis, every gateway pinned to CPU 0, wrk and the rest on CPU 1), one
gateway per build, measured in the same rounds, their order reversed every other round;
medians. What each change of issue 14 saved was measured this way (bench/README.md): one
build's runs on this VM spread by 3-5 %, two builds in the same rounds far less.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import baseline  # noqa: E402
import harness  # noqa: E402
import overhead  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("revs", nargs="+", help="git revisions, or . for this checkout")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=int, default=4)
    args = parser.parse_args()
    harness.need("wrk", "nginx", "taskset", "git")
    tmp = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    procs: list[harness.Proc] = []
    with (
        harness.bench_redis(tmp, cpu=harness.OTHERS_CPU) as redis_url,
        contextlib.ExitStack() as stack,
    ):
        try:
            upstream, static = harness.nginx_static(tmp, overhead.ANSWER)
            procs.append(upstream)
            (tmp / "gateway.yaml").write_text(
                overhead.config(redis_url, static, "http://127.0.0.1:9", "http://127.0.0.1:9")
            )
            gateways = []
            for i, rev in enumerate(args.revs):
                tree = None if rev == "." else stack.enter_context(baseline.checkout(rev))[0]
                gateways.append(overhead.gateway_process(tmp, f"gateway-{i}", tree))
                procs.append(gateways[-1])
            report(args, measure(tmp, gateways, args.rounds, args.seconds))
        finally:
            for proc in reversed(procs):
                proc.stop()


def measure(
    tmp: Path, gateways: list[harness.Proc], rounds: int, seconds: int
) -> list[dict[str, list[float]]]:
    script = tmp / "post.lua"
    script.write_text(harness.WRK_SCRIPT.format(body=overhead.BODY, key=overhead.KEY))
    urls = [gw.url + overhead.PATH for gw in gateways]
    for url in urls:
        harness.wrk(url, script, 32, 2)  # warm-up
    runs: list[dict[str, list[float]]] = [{"cpu": [], "rps": [], "p50": []} for _ in gateways]
    for i in range(rounds):
        order = list(range(len(gateways)))[:: 1 if i % 2 == 0 else -1]
        for g in order:
            before = gateways[g].cpu_seconds()
            run = harness.wrk(urls[g], script, 32, seconds)
            if run.non_2xx:
                sys.exit(f"{run.non_2xx} answers were not 2xx: {run.raw}")
            runs[g]["cpu"].append((gateways[g].cpu_seconds() - before) * 1e6 / run.requests)
            runs[g]["rps"].append(run.rps)
        for g in order:
            runs[g]["p50"].append(harness.wrk(urls[g], script, 1, 3).p50_ms)
    return runs


def report(args: argparse.Namespace, runs: list[dict[str, list[float]]]) -> None:
    for rev, run in zip(args.revs, runs, strict=True):
        each = " / ".join(f"{c:.1f}" for c in run["cpu"])
        cpu, rps, p50 = (statistics.median(run[k]) for k in ("cpu", "rps", "p50"))
        print(f"{rev:>12}  CPU us/req {cpu:6.1f} ({each})  req/s {rps:7.0f}  p50 c=1 {p50:.3f} ms")


if __name__ == "__main__":
    main()
