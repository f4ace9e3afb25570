"""What admission costs Redis itself: commands, CPU and a no-op EVALSHA's worth per request.

Run: .venv/bin/python bench/redis_cost.py [--admissions N] [--quick] [--json] [--redis URL]
     .venv/bin/python bench/redis_cost.py --cluster [--admissions N] [--quick] [--json]
     (on a Redis Cluster of three masters of its own: bench/cluster_cost.py)

Redis: a redis-server of the benchmark's own on a free port, unless --redis or REDIS_URL
names one (used as it is, never flushed: what the benchmark wrote is removed at the end).

One run, against the real Redis and the real admission code (routing/admission/admit.py):
1. one admitted request's life (`admit`, then `release` with a usage record) is captured
   at the store's `send`: its round trips, the exact commands sent, and what Redis ran for
   them (INFO commandstats counts the commands scripts call too);
2. that command sequence is replayed N times back to back (pipelined in batches, a fresh
   lease id each time, so each replay is a real admission and release), and so is a no-op
   EVALSHA (`return 0`): Redis's own microseconds per admission (INFO commandstats) and
   process CPU (used_cpu_user + sys), and their ratio to the no-op;
3. the same replay, fewer times, with the slow log as a stopwatch: microseconds per script;
4. an idle Admission + keeper (routing/admission/keeper.py), one replica, with 1 and with 10 models:
   what its sweeps cost Redis per model and second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

import cluster_cost  # noqa: E402
import harness  # noqa: E402
import rediskit  # noqa: E402
from lives import Command, config_text, one_life, per_second, recording, replay_lives  # noqa: E402
from rediskit import TAG, Delta, SlowLog, cost, measured, sent_counts, top_level_usec  # noqa: E402

from gateway.runtime.settings import parse_config  # noqa: E402
from routing.admission.admit import Admission  # noqa: E402
from routing.admission.keeper import Keeper  # noqa: E402
from routing.admission.plan import plan_candidates  # noqa: E402
from routing.registry import Registry  # noqa: E402
from routing.store.keys import account_key  # noqa: E402
from routing.store.resp import RespClient  # noqa: E402

NOOP = "return 0"
# No-ops per life replayed in a round: a life costs Redis about 25 of them, so a round of
# as many no-ops as lives lasted a twentieth as long, and a VM's scheduling noise moved
# its CPU reading by up to a fifth; ten per life make it about as long as the lives'.
NOOPS_PER_LIFE = 10
# Requests holding slots of the model while the loaded rounds replay (of its 32).
LOADED = 8
# What a replay needs: the store, the captured batches, their lease id, the acquire's sha.
Life = tuple[RespClient, list[list[Command]], str, str]


async def admission_for(url: str, models: Sequence[str], replica: str) -> tuple[Admission, Any]:
    """An Admission as `gateway serve` builds one for redis:// (the lean client on the hot
    path), its scripts loaded; and the plan of a request for the first model."""
    config = parse_config(config_text(models), "bench.yaml")
    registry = Registry(config.models)
    admission = Admission(
        RespClient(url), registry, config.tiers,
        lease_ttl_s=30, on_outage="reject", replica_id=replica,
    )  # fmt: skip
    await admission.start()
    plan = plan_candidates(models[0], None, fail_fast=False, registry=registry, allowed=None)
    return admission, plan


async def close(admission: Admission) -> None:
    await admission.close()
    await admission.store.aclose()


async def capture(
    admission: Admission, plan: Any, info: aioredis.Redis
) -> tuple[list[list[Command]], str, Delta]:
    """One admitted request's life: the batches it sent, its lease id, what Redis ran. A
    first life before it creates the model's state in Redis (a one-off)."""
    await one_life(admission, plan)
    leases: list[str] = []

    async def life() -> None:
        leases.append(await one_life(admission, plan))

    for _ in range(3):  # a life of a second's first record is captured again (lives.py)
        with recording(admission.store) as batches:
            delta = await measured(info, life())
        if not per_second(batches):
            break
    return batches, leases[-1], delta


async def replay(life: Life, n: int, batch: int, tag: str) -> None:
    """The captured life `n` times back to back, `batch` lives per round trip."""
    store, batches, lease_id, acquire = life
    await replay_lives(store, [(batches, lease_id)], acquire, n, batch, tag)


async def noops(store: RespClient, sha: str, n: int, batch: int) -> None:
    for start in range(0, n, batch):
        replies = await store.send([("EVALSHA", sha, 0)] * min(batch, n - start))
        if error := next((r for r in replies if isinstance(r, Exception)), None):
            raise error


def one_admission(batches: list[list[Command]], delta: Delta) -> dict[str, Any]:
    sent = sent_counts(batches)
    inner = Counter(delta.calls)
    inner.subtract(sent)
    return {
        "round_trips": len(batches),
        "commands_sent": sum(sent.values()),
        # Script calls, by EVALSHA or FCALL (routing/store/scripts.py).
        "evalsha": sent["evalsha"] + sent["fcall"],
        "commands_in_redis": delta.total_calls,
        "called_by_scripts": {k: v for k, v in sorted(inner.items()) if v > 0},
        # This request alone, its scripts run cold: the replays below give the steady cost.
        "usec": round(top_level_usec(delta, sent_counts(batches, top_level=True)), 1),
    }


async def rounds(
    info: aioredis.Redis, life: Life, noop_sha: str, n: int, batch: int, count: int
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """`count` rounds, each N lives then 10 N no-ops: per admission, and per no-op call."""
    lives, idle_calls = [], []
    sent = sent_counts(life[1], n, top_level=True)
    for r in range(count):
        delta = await measured(info, replay(life, n, batch, f"m{r}-"))
        lives.append({"usec": top_level_usec(delta, sent) / n, "cpu_usec": delta.cpu_s * 1e6 / n,
                      "commands_in_redis": delta.total_calls / n})  # fmt: skip
        calls = n * NOOPS_PER_LIFE
        delta = await measured(info, noops(life[0], noop_sha, calls, batch))
        idle_calls.append({"usec": delta.usec.get("evalsha", 0) / calls,
                           "cpu_usec": delta.cpu_s * 1e6 / calls})  # fmt: skip
    return lives, idle_calls


async def by_script(
    info: aioredis.Redis, life: Life, names: dict[str, str], n: int, batch: int, logged: int
) -> dict[str, Any] | None:
    """Microseconds per call of each command a life sends, from the slow log (threshold 0;
    `logged`: entries per life, the commands scripts call are logged too). None where CONFIG
    is not allowed."""
    try:
        async with SlowLog(info, room=2 * n * (logged + 1) + 64) as log:  # with room to spare
            await replay(life, n, batch, "s-")
            await noops(life[0], names["noop"], n, batch)
            entries = await log.entries()
    except aioredis.ResponseError:
        return None
    shas = {sha: name for name, sha in names.items()}
    total: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for args, usec in entries:
        name = None
        if args[0].upper() in ("EVALSHA", "FCALL") and len(args) > 1:
            name = shas.get(args[1])
        elif len(args) > 1 and args[1].startswith(("usage", "{usage}")):
            # The record's first send: a transaction, whose EXEC the slow log skips; its SET
            # and XADD are logged (once per life: the XADD counts the call).
            name = "usage"
            calls[name] += args[0].upper() == "XADD"
            total[name] += usec
            continue
        if name is not None:
            total[name] += usec
            calls[name] += 1
    rows = {k: {"calls_per_admission": round(calls[k] / n, 2),
                "usec_per_call": round(total[k] / calls[k], 2)} for k in calls}  # fmt: skip
    life_usec = sum(v for k, v in total.items() if k != "noop") / n
    noop = rows.get("noop", {}).get("usec_per_call", 0)
    return {"admissions": n, "scripts": rows, "usec_per_admission": round(life_usec, 2),
            "ratio_to_noop": round(life_usec / noop, 1) if noop else None}  # fmt: skip


async def idle(
    url: str, info: aioredis.Redis, cleanup: rediskit.Cleanup, count: int, seconds: float
) -> dict[str, Any]:
    """An idle replica with `count` models: its keeper's sweeps over `seconds`, per model."""
    replica = f"{TAG}-idle{count}"
    models = [f"{replica}-{i}" for i in range(count)]
    cleanup.replicas.append(replica)
    admission, _ = await admission_for(url, models, replica)
    pubsub = aioredis.Redis.from_url(url)
    keeper = Keeper(admission, pubsub, interval_s=1.0)
    try:
        with recording(admission.store) as batches:
            await keeper.start()
            await asyncio.sleep(0.5)  # subscribed, first sweep done: the steady state after
            skip = len(batches)
            delta = await measured(info, asyncio.sleep(seconds))
            window = batches[skip:]
    finally:
        await keeper.close()
        await close(admission)
        await pubsub.aclose()
    sent = sent_counts(window)
    per = count * seconds
    return {
        "models": count,
        "seconds": seconds,
        "sweeps": len(window),
        "per_model_per_s": {
            "round_trips": round(len(window) / per, 3),
            "commands_sent": round(sum(sent.values()) / per, 3),
            "commands_in_redis": round(delta.total_calls / per, 2),
            "usec": round(top_level_usec(delta, sent_counts(window, top_level=True)) / per, 2),
        },
    }


async def measure(url: str, n: int, batch: int, count: int, idle_s: float) -> dict[str, Any]:
    info = aioredis.Redis.from_url(url)
    results: dict[str, Any] = {"redis_version": (await info.info("server"))["redis_version"]}
    async with rediskit.Cleanup(info) as cleanup:
        admission, plan = await admission_for(url, [TAG], f"{TAG}-r")
        try:
            batches, lease_id, delta = await capture(admission, plan, info)
            results["one_admission"] = one_admission(batches, delta)
            assert isinstance(admission.store, RespClient)
            scripts = admission.scripts
            names = {n: scripts.called_as(n) for n in scripts.sha}
            names["noop"] = await info.script_load(NOOP)
            life: Life = (admission.store, batches, lease_id, names["acquire"])
            await replay(life, min(n, 500), batch, "w-")  # warm-up
            await noops(admission.store, names["noop"], min(n, 500), batch)
            results["cost"] = cost(*await rounds(info, life, names["noop"], n, batch, count))
            results["cost_loaded"] = await loaded(admission, plan, info, life, names["noop"],
                                                  n, batch, count)  # fmt: skip
            logged = results["one_admission"]["commands_in_redis"]
            results["by_script"] = await by_script(info, life, names, min(n, 1000), batch, logged)
            results["left_after_replay"] = await leftovers(info, admission)
        finally:
            await close(admission)
        results["idle"] = [await idle(url, info, cleanup, k, idle_s) for k in (1, 10)]
    await info.aclose()
    return results


async def loaded(
    admission: Admission,
    plan: Any,
    info: aioredis.Redis,
    life: Life,
    noop: str,
    n: int,
    batch: int,
    count: int,
) -> dict[str, Any]:
    """The same rounds while LOADED other requests of the account hold slots of the model,
    as under load: the model's leases and the account's count then exist before a request
    and after it (replayed alone, each request creates and deletes those keys)."""
    held = [await admission.admit(plan, TAG, 1000) for _ in range(LOADED)]
    try:
        return {"held": LOADED, **cost(*await rounds(info, life, noop, n, batch, count))}
    finally:
        for admitted in held:
            await admission.release(admitted.lease)


async def leftovers(info: aioredis.Redis, admission: Admission) -> dict[str, int]:
    """What the replays left held: nothing, if each gave back what it took."""
    keys = admission.slots[TAG].keys
    return {
        "leases": int(await info.zcard(keys[0])),
        "queued": int(await info.zcard(keys[1])),
        "account_entries": int(await info.zcard(account_key(TAG))),
    }


def report(results: dict[str, Any]) -> None:
    one, c = results["one_admission"], results["cost"]
    print(f"\nRedis {results['redis_version']}, one admitted request (admit + release with usage):")
    print(
        f"  round trips {one['round_trips']}, commands sent {one['commands_sent']} "
        f"(EVALSHA {one['evalsha']}), commands run in Redis {one['commands_in_redis']}"
    )
    print(f"  called by scripts: {one['called_by_scripts']}")
    print(f"\n{'replayed back to back':40} {'Redis usec':>11} {'CPU usec':>9} {'cmds':>6}")
    print(
        f"{'admission (per admit + release)':40} {c['usec_per_admission']:11.2f} "
        f"{c['cpu_usec_per_admission']:9.2f} {c['commands_in_redis_per_admission']:6.1f}"
    )
    print(
        f"{'no-op EVALSHA (per call)':40} {c['noop_evalsha_usec']:11.3f} "
        f"{c['noop_evalsha_cpu_usec']:9.3f} {1:6.1f}"
    )
    print(f"{'ratio to the no-op':40} {c['ratio_to_noop']!s:>11} {c['cpu_ratio_to_noop']!s:>9}")
    print(
        f"  target: <= {c['target_ratio']} by CPU ({c[c['target_measure']]}: "
        f"{'met' if c[c['target_measure']] <= c['target_ratio'] else 'NOT met'}); the "
        "commandstats time leaves out reading, parsing and answering, half a no-op's cost"
    )
    loaded = results["cost_loaded"]
    label = f"the same, {loaded['held']} others held"
    print(
        f"{label:40} {loaded['usec_per_admission']:11.2f} {loaded['cpu_usec_per_admission']:9.2f} "
        f"{loaded['commands_in_redis_per_admission']:6.1f}"
    )
    print(f"{'  its no-op EVALSHA':40} {loaded['noop_evalsha_usec']:11.3f} "
          f"{loaded['noop_evalsha_cpu_usec']:9.3f} {1:6.1f}")  # fmt: skip
    print(f"{'  its ratio':40} {loaded['ratio_to_noop']!s:>11} {loaded['cpu_ratio_to_noop']!s:>9}")
    print(f"left held after the replays: {results['left_after_replay']}")
    print(
        f"admissions/s on one Redis core: {c['admissions_per_s_per_core']} "
        f"(commandstats), {c['admissions_per_s_per_core_cpu']} (process CPU)"
    )
    report_details(results["by_script"], results["idle"])


def report_details(by: dict[str, Any] | None, idle_rows: list[dict[str, Any]]) -> None:
    if by is not None:
        print(
            f"\nslow log, {by['admissions']} admissions ({by['usec_per_admission']} usec, "
            f"{by['ratio_to_noop']} no-ops):"
        )
        for name, row in by["scripts"].items():
            print(
                f"  {name:16} {row['calls_per_admission']:5.2f} x {row['usec_per_call']:8.2f} usec"
            )
    print(
        f"\n{'idle replica, per model and second':40} {'trips':>7} {'sent':>7} "
        f"{'in Redis':>9} {'usec':>7}"
    )
    for row in idle_rows:
        p = row["per_model_per_s"]
        label = f"{row['models']} model(s), {row['seconds']:g} s"
        print(f"{label:40} {p['round_trips']:7.3f} {p['commands_sent']:7.3f} "
              f"{p['commands_in_redis']:9.2f} {p['usec']:7.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--admissions", type=int, default=20000, help="replays per round")
    parser.add_argument("--batch", type=int, default=100, help="replays per round trip")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; medians are reported")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="a short run (a few seconds)")
    parser.add_argument("--json", action="store_true", help="JSON on stdout, not the table")
    parser.add_argument("--redis", help="a Redis to use as it is (default: REDIS_URL, else "
                        "a redis-server of the benchmark's own)")  # fmt: skip
    parser.add_argument("--cluster", action="store_true", help="on a 3-master Redis Cluster "
                        "of its own: the cost per master, what three sustain")  # fmt: skip
    args = parser.parse_args()
    if args.cluster and args.redis:
        parser.error("--cluster starts a Cluster of its own: no --redis")
    n, count, idle_s = args.admissions, args.rounds, args.idle_seconds
    if args.quick:
        n, count, idle_s = 200, 1, 1.2
    with (
        tempfile.TemporaryDirectory(prefix="bench-cost-") as tmp,
        contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout),
    ):
        if args.cluster:
            results = cluster_cost.run(Path(tmp), n, args.batch, count)
        else:
            with harness.bench_redis(Path(tmp), args.redis) as url:
                results = asyncio.run(measure(url, n, args.batch, count, idle_s))
    results["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform()}  # fmt: skip
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        (cluster_cost.report if args.cluster else report)(results)


if __name__ == "__main__":
    main()
