"""What admission costs a Redis Cluster of three masters: `redis_cost.py --cluster`.

A Cluster of the benchmark's own (tests/redis_cluster.py: three masters on loopback, no
replicas), the real `Admission` on the real `ClusterStore` (routing/store/cluster.py, built by
routing/store/connect.py `cluster_store` as `gateway serve` does for a Cluster), with models and
accounts named so that their hash tags land on every master in turn. One admitted
request's life (admit, release with a usage record) is captured for each (model, account)
pair, then N lives are replayed spread evenly over the pairs, `batch` per round trip (the
store splits each batch per master, as it does the gateway's): per master, its process CPU
(used_cpu_user + sys) and commandstats usec.

A Cluster of three sustains N / (the busiest master's CPU seconds) admissions/s, were each
master on a core of its own; one core, N / (every master's CPU seconds together). The usage
stream is one key: its master takes every record, and bounds the Cluster.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from lives import Captured, config_text, one_life, per_second, recording, replay_lives
from redis.asyncio.cluster import RedisCluster as ClusterClient
from redis.crc import key_slot
from rediskit import STREAM, TAG, Delta, Snapshot, median, sent_counts, top_level_usec

from gateway.runtime.settings import parse_config
from routing.admission.admit import Admission
from routing.admission.plan import plan_candidates
from routing.registry import Registry
from routing.store.cluster import ClusterStore
from routing.store.connect import cluster_store
from routing.store.keys import account_key
from routing.store.slotmap import slot_of
from tests.redis_cluster import RedisCluster, start_cluster

MODELS_PER_MASTER = 2
ACCOUNTS_PER_MASTER = 1
Ranges = list[tuple[int, int, int]]  # (first slot, last slot, master's port)


def slot_ranges(cluster: RedisCluster) -> Ranges:
    with cluster.client(cluster.nodes[0]) as client:
        return [(int(a), int(b), int(node[1])) for a, b, node, *_ in client.cluster("SLOTS")]


def port_of(ranges: Ranges, tag: str) -> int:
    """The master of the hash tag `tag` (a key `...{tag}...`)."""
    slot = key_slot(tag.encode())
    return next(port for first, last, port in ranges if first <= slot <= last)


def spread(ranges: Ranges, prefix: str, per_master: int) -> list[str]:
    """Names `prefix0`, `prefix1`, ... picked so that each master serves `per_master` of
    them by hash tag; listed round robin over the masters."""
    found: dict[int, list[str]] = {port: [] for _, _, port in ranges}
    i = 0
    while any(len(names) < per_master for names in found.values()):
        name, i = f"{prefix}{i}", i + 1
        names = found[port_of(ranges, name)]
        if len(names) < per_master:
            names.append(name)
    return [name for row in zip(*found.values(), strict=True) for name in row]


async def capture(
    admission: Admission, registry: Registry, models: Sequence[str], accounts: Sequence[str]
) -> list[Captured]:
    """One life per (model, account), after a first that creates their state (a one-off)."""
    lives: list[Captured] = []
    for model in models:
        plan = plan_candidates(model, None, fail_fast=False, registry=registry, allowed=None)
        for account in accounts:
            await one_life(admission, plan, account)
            for _ in range(3):  # a life of a second's first record is captured again
                with recording(admission.store) as batches:
                    lease_id = await one_life(admission, plan, account)
                if not per_second(batches):
                    break
            lives.append((batches, lease_id))
    return lives


def sent_per_master(
    store: ClusterStore, lives: Sequence[Captured], n: int
) -> dict[int, Counter[str]]:
    """How many of each command N replays send each master (by port); a transaction
    counts as its MULTI and EXEC (EXEC's time includes its commands')."""
    sent: dict[int, Counter[str]] = {}
    for j, (batches, _) in enumerate(lives):
        times = n // len(lives) + (1 if j < n % len(lives) else 0)
        for command in (c for batch in batches for c in batch):
            node = store.node_of_slot(slot_of(command))
            assert node is not None, command  # a life sends keyed commands only
            sent.setdefault(node[1], Counter()).update(
                sent_counts([[command]], times, top_level=True)
            )
    return sent


async def measured_all(
    clients: dict[int, aioredis.Redis], work: Awaitable[None]
) -> dict[int, Delta]:
    """`work` between two snapshots of every master."""
    before = {port: await Snapshot.take(client) for port, client in clients.items()}
    await work
    after = {port: await Snapshot.take(c, cpu_first=True) for port, c in clients.items()}
    return {port: Delta.between(before[port], after[port]) for port in clients}


def figures(deltas: dict[int, Delta], sent: dict[int, Counter[str]], n: int) -> dict[str, Any]:
    """One round: per master, its share of each admission; the admissions/s they give."""
    cpu = {port: d.cpu_s for port, d in deltas.items()}
    usec = {port: top_level_usec(d, sent.get(port, Counter())) for port, d in deltas.items()}
    masters = {
        port: {
            "commands_sent_per_admission": round(sum(sent.get(port, Counter()).values()) / n, 2),
            "commands_in_redis_per_admission": round(d.total_calls / n, 2),
            "cpu_usec_per_admission": round(cpu[port] * 1e6 / n, 2),
            "cpu_share": round(cpu[port] / sum(cpu.values()), 3),
            "usec_per_admission": round(usec[port] / n, 2),
            "usec_share": round(usec[port] / sum(usec.values()), 3),
        }
        for port, d in deltas.items()
    }
    return {
        "masters": masters,
        "cpu_usec_per_admission": round(sum(cpu.values()) * 1e6 / n, 2),
        "usec_per_admission": round(sum(usec.values()) / n, 2),
        "admissions_per_s_per_core": round(n / sum(cpu.values())),
        "admissions_per_s_cluster_of_three": round(n / max(cpu.values())),
        "admissions_per_s_per_core_usec": round(n * 1e6 / sum(usec.values())),
        "admissions_per_s_cluster_of_three_usec": round(n * 1e6 / max(usec.values())),
    }


async def leftovers(
    admission: Admission, client: ClusterClient, accounts: Sequence[str]
) -> dict[str, int]:
    """What the replays left held, on whichever master: nothing, if each gave back all."""
    held = {"leases": 0, "queued": 0, "account_entries": 0}
    for slots in admission.slots.values():
        held["leases"] += int(await client.zcard(slots.keys[0]))
        held["queued"] += int(await client.zcard(slots.keys[1]))
    for account in accounts:
        held["account_entries"] += int(await client.zcard(account_key(account)))
    return held


async def measure(cluster: RedisCluster, n: int, batch: int, count: int) -> dict[str, Any]:
    ranges = slot_ranges(cluster)
    models = spread(ranges, f"{TAG}-m", MODELS_PER_MASTER)
    accounts = spread(ranges, f"{TAG}-a", ACCOUNTS_PER_MASTER)
    config = parse_config(config_text(models), "bench.yaml")
    registry = Registry(config.models)
    store = cluster_store(cluster.url, 2.0)
    assert isinstance(store, ClusterStore)
    admission = Admission(store, registry, config.tiers, lease_ttl_s=30, on_outage="reject",
                          replica_id=f"{TAG}-c")  # fmt: skip
    clients = {node.port: aioredis.Redis.from_url(node.url) for node in cluster.nodes}
    inspect = ClusterClient.from_url(cluster.url)
    try:
        await admission.start()
        lives = await capture(admission, registry, models, accounts)
        acquire = admission.scripts.called_as("acquire")
        await replay_lives(store, lives, acquire, min(n, 600), batch, "w-")  # warm-up
        sent = sent_per_master(store, lives, n)
        rounds = []
        for r in range(count):
            work = replay_lives(store, lives, acquire, n, batch, f"c{r}-")
            rounds.append(figures(await measured_all(clients, work), sent, n))
        results = summary(rounds, ranges, models, accounts)
        server = await clients[cluster.nodes[0].port].info("server")
        results.update(redis_version=server["redis_version"], admissions=n, batch=batch,
                       pairs=len(lives), round_trips=max(len(b) for b, _ in lives),
                       redirects=dict(store.redirects),
                       left_after_replay=await leftovers(admission, inspect, accounts))  # fmt: skip
    finally:
        await admission.close()
        await store.aclose()
        await inspect.aclose()
        for client in clients.values():
            await client.aclose()
    return results


def summary(rounds: list[dict[str, Any]], ranges: Ranges, models: Sequence[str],
            accounts: Sequence[str]) -> dict[str, Any]:  # fmt: skip
    """The round whose Cluster figure is the median, each master named by what it serves."""
    key = "admissions_per_s_cluster_of_three"
    chosen = next(r for r in rounds if r[key] == median(rounds, key))
    usage_port = port_of(ranges, STREAM)
    masters = []
    for port, row in sorted(chosen["masters"].items()):
        serves = {"models": [m for m in models if port_of(ranges, m) == port],
                  "accounts": [a for a in accounts if port_of(ranges, a) == port],
                  "usage_stream": port == usage_port}  # fmt: skip
        masters.append({"port": port, **serves, **row})
    keep = ("masters", "rounds")
    return {**{k: v for k, v in chosen.items() if k not in keep}, "masters": masters,
            "usage_master_cpu_share": chosen["masters"][usage_port]["cpu_share"],
            "usage_master_usec_share": chosen["masters"][usage_port]["usec_share"],
            "rounds": [{k: r[k] for k in ("admissions_per_s_per_core", key)}
                       for r in rounds]}  # fmt: skip


def run(tmp: Path, n: int, batch: int, count: int) -> dict[str, Any]:
    """Start the Cluster under `tmp`, measure, stop it."""
    cluster = start_cluster(tmp / "cluster")
    ports = ", ".join(str(node.port) for node in cluster.nodes)
    print(f"redis cluster: own masters on ports {ports}")
    try:
        return asyncio.run(measure(cluster, n, batch, count))
    finally:
        cluster.stop()


def report(results: dict[str, Any]) -> None:
    print(f"\nRedis {results['redis_version']} Cluster of {len(results['masters'])} masters, "
          f"{results['admissions']} admissions over {results['pairs']} (model, account) pairs, "
          f"{results['batch']} per round trip:")  # fmt: skip
    print(f"\n{'per admission, per master':34} {'sent':>5} {'in Redis':>9} {'CPU usec':>9} "
          f"{'share':>6} {'usec':>6} {'share':>6}")  # fmt: skip
    for m in results["masters"]:
        label = f"{m['port']} ({len(m['models'])} models, {len(m['accounts'])} account"
        label += ", usage)" if m["usage_stream"] else ")"
        print(f"{label:34} {m['commands_sent_per_admission']:5.2f} "
              f"{m['commands_in_redis_per_admission']:9.2f} {m['cpu_usec_per_admission']:9.2f} "
              f"{m['cpu_share']:6.1%} {m['usec_per_admission']:6.2f} "
              f"{m['usec_share']:6.1%}")  # fmt: skip
    print(f"{'all masters':34} {'':5} {'':9} {results['cpu_usec_per_admission']:9.2f} "
          f"{'':6} {results['usec_per_admission']:6.2f}")  # fmt: skip
    print(
        f"\nadmissions/s per Redis core: {results['admissions_per_s_per_core']} (CPU), "
        f"{results['admissions_per_s_per_core_usec']} (commandstats)"
    )
    print(
        f"admissions/s a Cluster of three sustains (its busiest master): "
        f"{results['admissions_per_s_cluster_of_three']} (CPU), "
        f"{results['admissions_per_s_cluster_of_three_usec']} (commandstats)"
    )
    print(f"the usage stream's master carries {results['usage_master_cpu_share']:.1%} of the CPU")
    print(f"rounds: {results['rounds']}")
    print(f"redirects: {results['redirects']}; left held: {results['left_after_replay']}")
