"""bench/redis_cost.py --quick runs end to end against a Redis of its own and leaves it as
it found it. Structure only: speed is the benchmark's business, never a test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.redis_server import RedisServer

# The benchmark's own processes (and a Redis Cluster): not in `make check`.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# What `--cluster` reports of each master, per admission.
PER_MASTER = (
    "commands_sent_per_admission",
    "commands_in_redis_per_admission",
    "cpu_usec_per_admission",
    "cpu_share",
    "usec_per_admission",
    "usec_share",
)


def test_quick_run_reports_every_figure_and_leaves_no_key(private_redis: RedisServer) -> None:
    # Given as --redis, so the benchmark treats it as someone else's: nothing flushed, only
    # what it wrote removed.
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "redis_cost.py"), "--quick", "--json",
         "--redis", private_redis.url],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)

    one = results["one_admission"]
    assert one["round_trips"] >= 1
    assert one["evalsha"] >= 1
    assert one["commands_sent"] >= one["evalsha"]
    assert one["commands_in_redis"] >= one["commands_sent"]
    assert one["usec"] > 0

    cost = results["cost"]
    for name in ("usec_per_admission", "cpu_usec_per_admission", "noop_evalsha_usec",
                 "ratio_to_noop", "admissions_per_s_per_core"):  # fmt: skip
        assert cost[name] > 0, name
    assert cost["commands_in_redis_per_admission"] >= one["commands_sent"]
    assert cost["target_ratio"] == 25
    assert cost[cost["target_measure"]] > 0

    by = results["by_script"]
    # On one Redis the account's slot is taken by the acquire script itself, and the record
    # is a transaction (EXEC).
    assert {"acquire", "release", "usage", "noop"} <= set(by["scripts"])
    assert all(row["calls_per_admission"] == 1 for row in by["scripts"].values())
    assert results["left_after_replay"] == {"leases": 0, "queued": 0, "account_entries": 0}

    assert [row["models"] for row in results["idle"]] == [1, 10]
    for row in results["idle"]:
        assert row["sweeps"] >= 1
        assert row["per_model_per_s"]["commands_in_redis"] > 0

    client = redis.Redis.from_url(private_redis.url)
    try:
        assert client.dbsize() == 0, sorted(client.scan_iter(count=1000))[:20]
    finally:
        client.close()


def test_cluster_quick_run_reports_each_master_and_leaves_nothing_held() -> None:
    # On a Cluster of its own (tests/redis_cluster.py), stopped when it is done.
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "redis_cost.py"), "--cluster", "--quick", "--json"],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)

    masters = results["masters"]
    assert len(masters) == 3
    assert len({m["port"] for m in masters}) == 3
    assert [m["usage_stream"] for m in masters].count(True) == 1
    for m in masters:  # every master serves models and an account of the run
        assert len(m["models"]) == 2 and len(m["accounts"]) == 1, m
        for name in PER_MASTER:
            assert m[name] > 0, (m["port"], name)
    assert sum(m["commands_sent_per_admission"] for m in masters) >= 4  # the scripts, at least
    assert abs(sum(m["cpu_share"] for m in masters) - 1) < 0.01

    for name in ("cpu_usec_per_admission", "usec_per_admission", "admissions_per_s_per_core",
                 "admissions_per_s_cluster_of_three", "admissions_per_s_per_core_usec",
                 "admissions_per_s_cluster_of_three_usec", "usage_master_cpu_share"):  # fmt: skip
        assert results[name] > 0, name
    # Its busiest master's CPU is at most all of theirs (arithmetic, not speed).
    assert results["admissions_per_s_cluster_of_three"] >= results["admissions_per_s_per_core"]
    assert results["admissions"] > 0 and results["pairs"] == 6 * 3
    assert results["left_after_replay"] == {"leases": 0, "queued": 0, "account_entries": 0}
