"""The fleet of the randomized fault test (tests/e2e/test_chaos.py) and the faults done to it.

One private redis-server with an append-only file, two simulated workers, and gateway
replicas (two live at a time) on that Redis. Faults, one at a time, each logged with when
it began and when it was over (time.monotonic(), the clock the workers' spans use too):

- `restart_empty`: kill -9, then start on the same port with nothing in it. The AOF of the
  run so far is moved aside (an "epoch"), not deleted, so the test can still read the usage
  records that Redis lost, from outside, after the run.
- `restart_kept`: kill -9, then start on the same port from its AOF (every write Redis
  acknowledged is there: the AOF is written before replies go out, and a killed process
  loses nothing the kernel already has). Connections break; no state is lost.
- `pause`: SIGSTOP for a while, then SIGCONT (connections stay open, nothing answers).
- `kill_replica`: kill -9 one gateway replica and start a new one on a new port.
- `nothing`.
"""

from __future__ import annotations

import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import redis

from tests.e2e import procs
from tests.redis_server import RedisServer, TextStreamEntries

REAL_FAULTS = ("restart_empty", "restart_kept", "pause", "kill_replica")


@dataclass(frozen=True)
class Fault:
    kind: str
    start: float
    end: float  # Redis answering again, resumed, or the new replica ready
    wall: float  # `start` on the wall clock (time.time()), which Redis's stream ids use
    detail: str = ""


@dataclass
class Replica:
    proc: procs.Proc
    name: str
    # When the test sent SIGKILL (time.monotonic()), or None while it lives.
    killed: float | None = None

    @property
    def url(self) -> str:
        return self.proc.url


@dataclass
class ChaosFleet:
    tmp: Path
    redis: RedisServer
    config: str  # the gateway config (the same for every replica)
    pause_s: tuple[float, float]  # how long a stall lasts: drawn between these
    replicas: list[Replica] = field(default_factory=list)  # every replica ever started
    live: list[Replica] = field(default_factory=list)  # those the driver may send to
    epochs: list[Path] = field(default_factory=list)  # AOFs of the Redis lost by restarts
    faults: list[Fault] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start_replica(self) -> Replica:
        replica = Replica(procs.gateway(self.tmp, self.config), f"g{len(self.replicas) + 1}")
        with self._lock:
            self.replicas.append(replica)
            self.live.append(replica)
        return replica

    def pick(self, rng: random.Random) -> Replica | None:
        with self._lock:
            return rng.choice(self.live) if self.live else None

    def stop(self) -> None:
        for replica in self.replicas:
            replica.proc.stop(signal.SIGKILL if replica.killed else signal.SIGTERM)
        self.redis.stop()

    # --- faults (blocking: the test runs them in a thread) ---------------------------------

    def inject(self, kind: str, rng: random.Random) -> Fault:
        start, wall = time.monotonic(), time.time()
        detail = getattr(self, "_" + kind)(rng)
        fault = Fault(kind, start, time.monotonic(), wall, detail)
        self.faults.append(fault)
        return fault

    def _restart_empty(self, rng: random.Random) -> str:
        self.redis.kill()
        aof = self.redis.dir / "appendonlydir"
        epoch = self.tmp / "epochs" / str(len(self.epochs))
        epoch.mkdir(parents=True)
        if aof.exists():
            shutil.move(aof, epoch / "appendonlydir")
        self.epochs.append(epoch)
        self.redis.start()
        return f"epoch {len(self.epochs)}"

    def _restart_kept(self, rng: random.Random) -> str:
        self.redis.kill()
        self.redis.start()
        return ""

    def _pause(self, rng: random.Random) -> str:
        seconds = rng.uniform(*self.pause_s)
        self.redis.pause()
        try:
            time.sleep(seconds)  # the fault itself: Redis stalled this long
        finally:
            self.redis.resume()
        return f"{seconds:.2f}s"

    def _kill_replica(self, rng: random.Random) -> str:
        victim = self.pick(rng)
        if victim is None:
            return "none live"
        with self._lock:
            self.live.remove(victim)
        victim.killed = time.monotonic()
        victim.proc.stop(signal.SIGKILL)
        born = self.start_replica()
        return f"{victim.name} killed, {born.name} started"

    def _nothing(self, rng: random.Random) -> str:
        return ""


def read_usage(url: str) -> list[dict[str, str]]:
    """Every record in the stream `usage` of the Redis at `url`, with "_at": when Redis
    appended it (its stream id, seconds on the wall clock)."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return [
            {**fields, "_at": str(int(entry.split("-")[0]) / 1000)}
            for entry, fields in cast(TextStreamEntries, client.xrange("usage"))
        ]
    finally:
        client.close()


def read_epoch(epoch: Path, tmp: Path) -> list[dict[str, str]]:
    """The usage records of a Redis lost by a restart: its AOF, loaded by a redis-server of
    its own for the time of one read."""
    reader = RedisServer(tmp / "readers", persistent=True)
    shutil.copytree(epoch / "appendonlydir", reader.dir / "appendonlydir")
    reader.start()
    try:
        return read_usage(reader.url)
    finally:
        reader.stop()
