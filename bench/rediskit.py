"""Server-side readings for bench/redis_cost.py: INFO deltas, the slow log as a per-call
stopwatch, and the cleanup of every key the benchmark wrote (it may run on a Redis it did
not start, which it must leave as it found it)."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from routing.store.keys import BEAT_PREFIX, REPLICAS_KEY, account_key
from routing.store.wire import Transaction, unfolded

# Every name the benchmark writes under: models, account, replicas, request ids.
TAG = "bench-cost"
STREAM = "usage"

# The acceptance: an admission costs Redis <= 25 no-op EVALSHAs. What a call costs
# Redis is the core time it takes: process CPU, which counts reading, parsing and answering
# the command as well as running it. The commandstats time counts the running alone (about
# half of a no-op's CPU), so its ratio weighs an admission against a part of a no-op only;
# it is reported beside, not judged.
TARGET_RATIO = 25
TARGET_MEASURE = "cpu_ratio_to_noop"


@dataclass
class Snapshot:
    """Redis's own counters at one moment: per command (calls, usec) and process CPU."""

    commands: dict[str, tuple[int, int]]
    cpu_s: float

    @classmethod
    async def take(cls, client: aioredis.Redis, *, cpu_first: bool = False) -> Snapshot:
        """`cpu_first` for the reading after: the CPU of the INFO calls stays outside."""
        cpu = await client.info("cpu") if cpu_first else None
        stats = await client.info("commandstats")
        cpu = cpu or await client.info("cpu")
        commands = {
            name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for name, v in stats.items()
        }
        return cls(commands, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))


@dataclass
class Delta:
    """What Redis did between two snapshots, the INFO calls of the readings left out."""

    calls: dict[str, int] = field(default_factory=dict)
    usec: dict[str, int] = field(default_factory=dict)
    cpu_s: float = 0.0

    @classmethod
    def between(cls, before: Snapshot, after: Snapshot) -> Delta:
        delta = cls(cpu_s=after.cpu_s - before.cpu_s)
        for name, (calls, usec) in after.commands.items():
            was_calls, was_usec = before.commands.get(name, (0, 0))
            if name != "info" and calls > was_calls:
                delta.calls[name] = calls - was_calls
                delta.usec[name] = usec - was_usec
        return delta

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())


async def measured(client: aioredis.Redis, work: Any) -> Delta:
    """Run the awaitable `work` between two snapshots."""
    before = await Snapshot.take(client)
    await work
    return Delta.between(before, await Snapshot.take(client, cpu_first=True))


def top_level_usec(delta: Delta, sent: Counter[str]) -> float:
    """Redis's microseconds for the commands sent (`sent`: how many of each). A script's
    time includes the commands it calls; a command also called by scripts (ZREM) gets its
    share of that command's time by count."""
    usec = 0.0
    for name, count in sent.items():
        calls = delta.calls.get(name, 0)
        if calls:
            usec += delta.usec[name] * min(1.0, count / calls)
    return usec


# What a transaction counts as at the top level: EXEC's time includes its commands'.
_EXEC_ONLY = [("MULTI",), ("EXEC",)]


def sent_counts(
    batches: Sequence[Sequence[Any]], times: int = 1, *, top_level: bool = False
) -> Counter[str]:
    """Commands sent by name (a transaction's MULTI, commands and EXEC each count).
    `top_level`: without a transaction's own commands, whose time EXEC's includes (as a
    script's includes the commands it calls)."""
    names = Counter(
        str(one[0]).lower()
        for b in batches
        for cmd in b
        for one in (_EXEC_ONLY if top_level and isinstance(cmd, Transaction) else unfolded(cmd))
    )
    return Counter({n: c * times for n, c in names.items()})


def median(rows: list[dict[str, float]], key: str) -> float:
    values = sorted(row[key] for row in rows)
    return values[len(values) // 2]


def cost(lives: list[dict[str, float]], calls: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over the rounds. The ratios are each round's lives over the no-ops measured
    right after them, then their median: paired, they leave out the machine's drift from
    round to round (other jobs on a VM's cores), which the ratio of two medians keeps."""
    usec, cpu = median(lives, "usec"), median(lives, "cpu_usec")
    noop, noop_cpu = median(calls, "usec"), median(calls, "cpu_usec")
    return {
        "usec_per_admission": round(usec, 2),
        "cpu_usec_per_admission": round(cpu, 2),
        "commands_in_redis_per_admission": round(median(lives, "commands_in_redis"), 2),
        "noop_evalsha_usec": round(noop, 3),
        "noop_evalsha_cpu_usec": round(noop_cpu, 3),
        "ratio_to_noop": _paired(lives, calls, "usec"),
        "cpu_ratio_to_noop": _paired(lives, calls, "cpu_usec"),
        "target_ratio": TARGET_RATIO,
        "target_measure": TARGET_MEASURE,
        "admissions_per_s_per_core": round(1e6 / usec) if usec else None,
        "admissions_per_s_per_core_cpu": round(1e6 / cpu) if cpu else None,
        "rounds": {"admission": lives, "noop": calls},
    }


def _paired(lives: list[dict[str, float]], calls: list[dict[str, float]], key: str) -> float | None:
    ratios = [life[key] / call[key] for life, call in zip(lives, calls, strict=True) if call[key]]
    return round(statistics.median(ratios), 1) if ratios else None


class SlowLog:
    """The slow log with a threshold of 0 logs every command with the microseconds Redis
    measured for it (the same measure as INFO commandstats), so one EVALSHA can be told
    from another. The settings it changes are restored; entries before it are not read."""

    def __init__(self, client: aioredis.Redis, room: int) -> None:
        self.client = client
        self.room = room
        self._saved: dict[str, str] = {}
        self._last_id = -1

    async def __aenter__(self) -> SlowLog:
        for name in ("slowlog-log-slower-than", "slowlog-max-len"):
            self._saved.update(await self.client.config_get(name))
        await self.client.config_set("slowlog-max-len", max(self.room, 128))
        last = await self.client.slowlog_get(1)
        self._last_id = int(last[0]["id"]) if last else -1
        await self.client.config_set("slowlog-log-slower-than", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for name, value in self._saved.items():
            await self.client.config_set(name, value)

    async def entries(self) -> list[tuple[list[str], int]]:
        """(first arguments, usec) of each command logged since entering, oldest first."""
        raw = await self.client.slowlog_get(self.room)
        found = []
        for entry in reversed(raw):
            if int(entry["id"]) <= self._last_id:
                continue
            command = entry["command"]
            text = command.decode(errors="replace") if isinstance(command, bytes) else command
            found.append((text.split(" ", 2)[:2], int(entry["duration"])))
        return found


class Cleanup:
    """Removes what the benchmark wrote: its models' and account's keys, its usage records
    (the whole stream only if it did not exist before) and its replicas' heartbeats."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.replicas: list[str] = []
        self._stream_existed = True
        self._started_ms = 0

    async def __aenter__(self) -> Cleanup:
        self._stream_existed = bool(await self.client.exists(STREAM))
        self._started_ms = int(time.time() * 1000) - 1000
        return self

    async def __aexit__(self, *exc: object) -> None:
        client = self.client
        for pattern in ("gw:v2:{" + TAG + "*", account_key(TAG)):
            async for key in client.scan_iter(match=pattern, count=1000):
                await client.delete(key)
        # The identities of the records it wrote, in the sets of their seconds.
        async for key in client.scan_iter(match="{usage}:rids:*", count=1000):
            ours = [m async for m in client.sscan_iter(key, match=TAG + "*", count=1000)]
            for start in range(0, len(ours), 1000):
                await client.srem(key, *ours[start : start + 1000])
        if self.replicas:
            await client.zrem(REPLICAS_KEY, *self.replicas)
            await client.delete(*(BEAT_PREFIX + r for r in self.replicas))
        if not self._stream_existed:
            await client.delete(STREAM)
            return
        for entry_id, fields in await client.xrange(STREAM, min=f"{self._started_ms}-0"):
            if fields.get(b"request_id", b"").startswith(TAG.encode()):
                await client.xdel(STREAM, entry_id)
