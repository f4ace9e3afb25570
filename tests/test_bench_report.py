"""The overhead benchmark's report logic (bench/verdict.py): ratios of what each hop adds, a
verdict per target, the soak's RSS slope. Pure functions on made-up results, no benchmark run;
plus the /proc and wrk readings of bench/harness.py on this process and a recorded output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import baseline
import harness
import spy
import verdict


def results(baseline_rps: float | None = 1000) -> dict[str, Any]:
    tp: dict[str, Any] = {
        "direct": {"rps": 80000, "cpu_ms_per_request": 0.007},
        "nginx_proxy": {"rps": 40000, "cpu_ms_per_request": 0.02},
        "gateway": {"rps": 2500, "cpu_ms_per_request": 0.4},
    }
    lat = {
        "direct": {"p50_ms": 0.015},
        "nginx_proxy": {"p50_ms": 0.045},
        "gateway": {"p50_ms": 0.615},
    }
    stream = {
        "direct": {"ttfb_p50_ms": 0.4},
        "nginx_proxy": {"ttfb_p50_ms": 0.5},
        "gateway": {"ttfb_p50_ms": 1.5},
    }
    if baseline_rps is not None:
        tp["baseline"] = {"rps": baseline_rps, "cpu_ms_per_request": 0.5}
    return {"throughput_c32": tp, "latency_c1": lat, "stream_64_chunks": stream}


def test_each_target_is_a_ratio_of_what_the_hops_add() -> None:
    found = verdict.checks(results())
    assert [name for name in found] == [t.name for t in verdict.TARGETS]
    cpu = found["cpu_per_request_vs_nginx"]
    assert (cpu["numerator"], cpu["denominator"], cpu["ratio"]) == (0.4, 0.02, 20)
    assert cpu["target"] == "<= 15" and cpu["verdict"] == verdict.FAIL
    p50 = found["added_p50_c1_vs_nginx"]  # (0.615 - 0.015) / (0.045 - 0.015)
    assert (p50["numerator"], p50["denominator"], p50["ratio"]) == (0.6, 0.03, 20)
    assert p50["verdict"] == verdict.FAIL
    ttfb = found["added_ttfb_vs_nginx"]  # (1.5 - 0.4) / (0.5 - 0.4)
    assert ttfb["ratio"] == 11 and ttfb["verdict"] == verdict.PASS
    speed = found["rps_c32_vs_baseline"]
    assert speed["ratio"] == 2.5 and speed["target"] == ">= 2"
    assert speed["verdict"] == verdict.PASS
    assert verdict.efficiency_vs_baseline(results()) == 1.25  # 0.5 / 0.4 ms per request


def test_the_limits_themselves_pass() -> None:
    by_name = {t.name: t for t in verdict.TARGETS}
    assert verdict.verdict(15, by_name["cpu_per_request_vs_nginx"]) == verdict.PASS
    assert verdict.verdict(15.01, by_name["cpu_per_request_vs_nginx"]) == verdict.FAIL
    assert verdict.verdict(2, by_name["rps_c32_vs_baseline"]) == verdict.PASS
    assert verdict.verdict(1.99, by_name["rps_c32_vs_baseline"]) == verdict.FAIL


def test_no_baseline_or_a_hop_that_adds_nothing_is_not_a_verdict() -> None:
    found = verdict.checks(results(baseline_rps=None))
    assert found["rps_c32_vs_baseline"]["ratio"] is None
    assert found["rps_c32_vs_baseline"]["verdict"] == verdict.UNKNOWN
    assert verdict.efficiency_vs_baseline(results(baseline_rps=None)) is None
    assert verdict.ratio(1.0, 0.0) is None
    assert verdict.ratio(1.0, -0.01) is None
    assert verdict.ratio(None, 1.0) is None
    lines = verdict.check_lines(found)
    assert len(lines) == len(verdict.TARGETS)
    assert "N/A" in lines[-1] and "FAIL" in lines[0]


def test_the_soak_slope_is_per_minute_and_flat_when_rss_is() -> None:
    assert verdict.slope_per_minute([(0, 60.0), (10, 60.0), (20, 60.0)]) == 0
    assert verdict.slope_per_minute([(0, 60.0), (30, 61.0), (60, 62.0)]) == 2
    assert verdict.slope_per_minute([(0, 60.0)]) is None
    rising = [(t, 60 + t / 60) for t in range(0, 130, 10)]
    summary = verdict.rss_summary([(0, 70.0), *rising[1:]])
    assert summary["start_mib"] == 70 and summary["end_mib"] == 62
    assert summary["max_mib"] == 70 and summary["growth_mib"] == -8
    assert summary["slope_second_half_mib_per_min"] == 1
    with pytest.raises(ValueError):
        verdict.rss_summary([])


def test_cpu_and_rss_count_the_children_too() -> None:
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                          stdin=subprocess.PIPE) as child:  # fmt: skip
        try:
            proc = harness.Proc(child, 0)
            assert proc.popen.pid in harness.tree(proc.popen.pid)
            mine = harness.tree(os.getpid())
            assert child.pid in mine
            assert proc.rss_mib() > 1 and proc.cpu_seconds() >= 0
        finally:
            child.communicate(b"")


WRK_OUTPUT = """Running 2s test @ http://127.0.0.1:1/v1/completions
  1 threads and 32 connections
  Latency Distribution
     50%  412.00us
     75%  600.00us
     90%    1.20ms
     99%    2.50ms
  5120 requests in 2.00s, 1.20MB read
  Non-2xx or 3xx responses: 3
Requests/sec:   2560.00
"""


def test_wrk_output_is_read() -> None:
    run = harness.parse_wrk(WRK_OUTPUT)
    assert (run.rps, run.requests, run.non_2xx) == (2560.0, 5120, 3)
    assert (run.p50_ms, run.p99_ms) == (0.412, 2.5)


STACKS = """\
<module> (gateway/__main__.py:5);run (asyncio/runners.py:118) 10
<module> (gateway/__main__.py:5);run (asyncio/runners.py:118);_run (asyncio/events.py:84);\
handle (gateway/completions/route.py:40);dumps (json/__init__.py:231) 20
<module> (gateway/__main__.py:5);_run (asyncio/events.py:84);send (routing/store/resp.py:90) 30
<module> (gateway/__main__.py:5);_run (asyncio/events.py:84);post (gateway/completions/hop.py:12);\
_request (aiohttp/client.py:500);shield (asyncio/tasks.py:900) 40
"""


def test_a_profile_sample_counts_for_the_innermost_known_part() -> None:
    assert spy.by_part(STACKS) == {
        "aiohttp (the hop to workers)": 40.0,  # its asyncio call counts for it
        "the Redis client": 30.0,
        "the gateway's own Python": 20.0,  # json for the route that called it
        "the event loop": 10.0,
    }
    top = spy.top_self(STACKS, 2)
    assert top == [("shield (asyncio/tasks.py)", 40.0), ("send (routing/store/resp.py)", 30.0)]


def test_a_baseline_tree_must_supply_the_packages_itself(tmp_path: Path) -> None:
    # Its own gateway, routing and tiers are used; without them the editable install would
    # answer with this checkout's, which the harness refuses.
    for name in baseline.PACKAGES:
        (tmp_path / "tree" / name).mkdir(parents=True)
        (tmp_path / "tree" / name / "__init__.py").write_text("")
    baseline.check_imports(tmp_path / "tree")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="load from this checkout"):
        baseline.check_imports(tmp_path / "empty")
