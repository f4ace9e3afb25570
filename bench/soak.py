"""The soak (bench/overhead.py --soak SECONDS): c=32 against the gateway for that long, its
RSS (the process and its children) sampled every few seconds while wrk runs."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from typing import Any

import harness
import verdict


def soak(gw: harness.Proc, script: Path, seconds: int, every: float) -> dict[str, Any]:
    """wrk at c=32 for `seconds`, RSS sampled every `every` s from its start to its end."""
    harness.wrk(gw.url + "/v1/completions", script, 32, 2)  # warm-up, not sampled
    args = harness.wrk_args(gw.url + "/v1/completions", script, 32, seconds)
    samples: list[tuple[float, float]] = []
    start = time.monotonic()
    cpu_before = gw.cpu_seconds()
    with subprocess.Popen(args, stdout=subprocess.PIPE, text=True) as load:
        while load.poll() is None:
            samples.append((round(time.monotonic() - start, 1), round(gw.rss_mib(), 2)))
            with contextlib.suppress(subprocess.TimeoutExpired):
                load.wait(timeout=every)  # returns early when wrk is done
        out = load.stdout.read() if load.stdout else ""
    last = (round(time.monotonic() - start, 1), round(gw.rss_mib(), 2))
    if samples and samples[-1][0] > last[0] - 1:  # one taken just as wrk ended: this instead
        samples.pop()
    samples.append(last)
    if load.returncode != 0:
        raise RuntimeError(f"wrk exited {load.returncode}: {out[-1500:]}")
    run = harness.parse_wrk(out)
    cpu = (gw.cpu_seconds() - cpu_before) * 1000 / max(1, run.requests)
    return {
        "seconds": seconds,
        "connections": 32,
        "requests": run.requests,
        "rps": round(run.rps),
        "non_2xx": run.non_2xx,
        "cpu_ms_per_request": round(cpu, 3),
        "p50_ms": run.p50_ms,
        "p99_ms": run.p99_ms,
        "rss": verdict.rss_summary(samples),
        "rss_samples": samples,
    }


def print_soak(results: dict[str, Any]) -> None:
    rss = results["rss"]
    print(
        f"soak, c=32 for {results['seconds']} s: {results['rps']} req/s, "
        f"{results['non_2xx']} non-2xx, {results['cpu_ms_per_request']} ms CPU per request"
    )
    print(
        f"  gateway RSS: start {rss['start_mib']} MiB, end {rss['end_mib']} MiB, "
        f"max {rss['max_mib']} MiB, growth {rss['growth_mib']} MiB"
    )
    print(
        f"  slope {rss['slope_mib_per_min']} MiB/min over all "
        f"{len(results['rss_samples'])} samples, "
        f"{rss['slope_second_half_mib_per_min']} MiB/min over the second half"
    )
