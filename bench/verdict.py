"""The overhead benchmark's targets (issue 14) as ratios of figures measured in one run, each
with its verdict, and the soak's RSS summary. Pure functions of the results, no I/O
(tests/test_bench_report.py checks them)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PASS, FAIL, UNKNOWN = "pass", "fail", "n/a"


@dataclass(frozen=True)
class Target:
    name: str
    text: str  # what the ratio is, for the printed summary
    op: str  # "<=" or ">="
    limit: float


TARGETS = (
    Target("cpu_per_request_vs_nginx", "gateway CPU per request / nginx's (c=32)", "<=", 15),
    Target("added_p50_c1_vs_nginx", "gateway added p50 / nginx's added p50 (c=1)", "<=", 12),
    Target("added_ttfb_vs_nginx", "gateway added TTFB / nginx's added TTFB (stream)", "<=", 12),
    Target("rps_c32_vs_baseline", "gateway req/s / the baseline's req/s (c=32)", ">=", 2),
)
_OPS = {"<=": operator.le, ">=": operator.ge}


def added(through: float, direct: float) -> float:
    """What a hop adds: the figure through it minus the same figure straight to the upstream."""
    return round(through - direct, 3)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None when either is missing or the denominator is not above
    zero (a hop that measured as adding nothing can not be a unit)."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return round(numerator / denominator, 2)


def verdict(value: float | None, target: Target) -> str:
    if value is None:
        return UNKNOWN
    return PASS if _OPS[target.op](value, target.limit) else FAIL


def inputs(results: dict[str, Any]) -> dict[str, tuple[float | None, float | None]]:
    """Each target's (numerator, denominator), from the results of bench/overhead.py."""
    tp, lat = results["throughput_c32"], results["latency_c1"]
    stream = results["stream_64_chunks"]
    p50 = {name: row["p50_ms"] for name, row in lat.items()}
    ttfb = {name: row["ttfb_p50_ms"] for name, row in stream.items()}
    baseline = tp.get("baseline")
    return {
        "cpu_per_request_vs_nginx": (
            tp["gateway"]["cpu_ms_per_request"],
            tp["nginx_proxy"]["cpu_ms_per_request"],
        ),
        "added_p50_c1_vs_nginx": (
            added(p50["gateway"], p50["direct"]),
            added(p50["nginx_proxy"], p50["direct"]),
        ),
        "added_ttfb_vs_nginx": (
            added(ttfb["gateway"], ttfb["direct"]),
            added(ttfb["nginx_proxy"], ttfb["direct"]),
        ),
        "rps_c32_vs_baseline": (tp["gateway"]["rps"], baseline["rps"] if baseline else None),
    }


def checks(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every target: its numerator, denominator, ratio, limit and verdict."""
    found = inputs(results)
    out: dict[str, dict[str, Any]] = {}
    for target in TARGETS:
        numerator, denominator = found[target.name]
        value = ratio(numerator, denominator)
        out[target.name] = {
            "what": target.text,
            "numerator": numerator,
            "denominator": denominator,
            "ratio": value,
            "target": f"{target.op} {target.limit:g}",
            "verdict": verdict(value, target),
        }
    return out


def efficiency_vs_baseline(results: dict[str, Any]) -> float | None:
    """Requests per CPU-second of the gateway over the baseline's (the baseline's CPU per
    request / the gateway's): the 2x comparison read from CPU time, which other jobs on the
    machine disturb far less than req/s (not a target, a cross-check)."""
    tp = results["throughput_c32"]
    if "baseline" not in tp:
        return None
    return ratio(tp["baseline"]["cpu_ms_per_request"], tp["gateway"]["cpu_ms_per_request"])


def check_lines(found: dict[str, dict[str, Any]]) -> list[str]:
    """The printed summary of `checks`, one line per target."""
    lines = []
    for row in found.values():
        shown = "n/a" if row["ratio"] is None else f"{row['ratio']:g}"
        parts = f"({row['numerator']} / {row['denominator']})"
        lines.append(
            f"  {row['verdict'].upper():5} {row['what']:50} {shown:>8}"
            f"  target {row['target']:6} {parts}"
        )
    return lines


def slope_per_minute(samples: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) samples, per minute; None under two samples."""
    if len(samples) < 2:
        return None
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_v = sum(v for _, v in samples) / n
    spread = sum((t - mean_t) ** 2 for t, _ in samples)
    if spread == 0:
        return None
    covar = sum((t - mean_t) * (v - mean_v) for t, v in samples)
    return round(covar / spread * 60, 3)


def rss_summary(samples: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """The soak's RSS: start, end, max (MiB), the slope over all samples and over the second
    half (MiB per minute; warm-up growth shows in the first, a leak in both)."""
    if not samples:
        raise ValueError("no RSS samples")
    values = [v for _, v in samples]
    return {
        "start_mib": round(values[0], 1),
        "end_mib": round(values[-1], 1),
        "max_mib": round(max(values), 1),
        "growth_mib": round(values[-1] - values[0], 1),
        "slope_mib_per_min": slope_per_minute(samples),
        "slope_second_half_mib_per_min": slope_per_minute(samples[len(samples) // 2 :]),
    }
