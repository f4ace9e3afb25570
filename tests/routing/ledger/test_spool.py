"""The usage spool's files (routing/ledger/spoolfile.py, UsageSpool in routing/ledger/spool.py): one
per process and store, locked for the process's life; torn lines set aside, never fatal; spools of
gone processes adopted by a gateway of the same store only, exactly once."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import orjson
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from routing.ledger import spoolfile
from routing.ledger.records import UsageSettings, store_sender
from routing.ledger.spool import UsageSpool
from routing.store.connect import RedisPyStore
from routing.store.keys import USAGE_STREAM
from routing.store.scripts import Call, Scripts
from tests.conftest import REDIS_URL
from tests.redis_server import StreamEntries

RID = "t-spool-"
OTHER_URL = "redis://127.0.0.1:1/0"  # another store (nothing listens: never sent to)
BOUND_S = 10.0
T = TypeVar("T")


async def bounded(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, BOUND_S)


def record(i: int | str) -> dict[str, str]:
    return {"request_id": f"{RID}{i}", "account": "t-spool", "status": "200"}


def spool_in(directory: Path, url: str = REDIS_URL, max_bytes: int = 1024 * 1024) -> UsageSpool:
    return UsageSpool(UsageSettings(spool_dir=str(directory), spool_max_bytes=max_bytes), url)


def lines_of(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


class Recorder:
    """A `Send` that takes every record (or refuses some, or fails), noting what it got."""

    def __init__(self, refuse: set[str] | None = None, fail_after: int | None = None) -> None:
        self.batches: list[list[str]] = []
        self.refuse = refuse or set()
        self.fail_after = fail_after  # batches answered before Redis "goes away"

    @property
    def sent(self) -> list[str]:
        return [rid for batch in self.batches for rid in batch if rid not in self.refuse]

    async def __call__(self, calls: Sequence[Call]) -> list[Any]:
        if self.fail_after is not None and len(self.batches) >= self.fail_after:
            raise RedisConnectionError("gone")
        if calls[0][0] == "TIME":
            return [[b"1700000000", b"0"]]
        if calls[0][0] == "XTRIM":
            return [0, 0, []]
        rids = [_rid(args) for _, _, args in calls]
        self.batches.append(rids)
        await asyncio.sleep(0)  # a real send lets other tasks run meanwhile
        return [ResponseError("OOM") if rid in self.refuse else 1 for rid in rids]


def _rid(args: Sequence[Any]) -> str:
    pairs = list(args)[2:]
    return str(dict(zip(pairs[::2], pairs[1::2], strict=True))["request_id"])


def spool_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.suffix in (".jsonl", ".lock")]


def gone_process_spool(directory: Path, url: str, rids: Sequence[str]) -> Path:
    """A spool left by a process that exited (its lock went with it); its data file."""
    code = (
        "import sys\n"
        "from routing.ledger.records import UsageSettings\n"
        "from routing.ledger.spool import UsageSpool\n"
        "spool = UsageSpool(UsageSettings(spool_dir=sys.argv[1]), sys.argv[2])\n"
        "for rid in sys.argv[3:]:\n"
        "    assert spool.add({'request_id': rid, 'account': 't-spool', 'status': '200'})\n"
        "print(spool.path)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(directory), url, *rids],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return Path(done.stdout.strip())


# --- naming and locking ------------------------------------------------------------------------


def test_store_identity_leaves_out_credentials_and_keeps_the_database() -> None:
    ident = spoolfile.store_identity
    plain = ident("redis://cache.internal:6379/0")
    assert re.fullmatch(r"[0-9a-f]{12}", plain)
    assert ident("redis://:secret@cache.internal:6379/0") == plain
    assert ident("redis://user:other@CACHE.internal:6379/0") == plain
    assert ident("redis://cache.internal:6379") == plain
    assert ident("redis://cache.internal:6379/0?password=x") == plain
    assert ident("redis://cache.internal:6379/1") != plain
    assert ident("redis://cache.internal:6380/0") != plain
    assert ident("rediss://cache.internal:6379/0") != plain
    # memory:// is one process's own store: a new identity every time.
    assert ident("memory://") != ident("memory://")


def test_nothing_is_written_before_the_first_record(tmp_path: Path) -> None:
    spool = spool_in(tmp_path / "spool")
    assert not spool.pending()
    assert spool.size_bytes() == 0
    assert not (tmp_path / "spool").exists()


def test_the_file_names_carry_the_store_and_the_process(tmp_path: Path) -> None:
    spool = spool_in(tmp_path / "missing" / "dir")  # created when needed
    assert spool.add(record(1))
    store = spoolfile.store_identity(REDIS_URL)
    name = re.fullmatch(
        rf"gateway-usage-{store}-{os.getpid()}-([0-9a-f]{{8}})\.jsonl", spool.path.name
    )
    assert name is not None
    assert lines_of(spool.path) == [record(1)]
    assert spool.size_bytes() == spool.path.stat().st_size > 0
    # Its lock is held for the process's life: nobody else can take it.
    lock = spool.path.with_suffix(".lock")
    assert spoolfile.try_lock(lock) is None
    # Two spools of one process and store are two files.
    other = spool_in(tmp_path / "missing" / "dir")
    assert other.add(record(2))
    assert other.path != spool.path


def test_close_removes_an_empty_spool_and_keeps_a_full_one(tmp_path: Path) -> None:
    empty, full = spool_in(tmp_path), spool_in(tmp_path)
    empty.add(record(1))
    empty.path.write_bytes(b"")  # as after a flush
    full.add(record(2))
    empty.close()
    full.close()
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".jsonl", ".lock"]
    assert spoolfile.try_lock(full.path.with_suffix(".lock")) is None  # still ours
    assert empty.add(record(3))  # a late record still finds a home
    assert lines_of(empty.path) == [record(3)]


# --- what cannot be kept is counted, never raised ---------------------------------------------


def test_full_spool_refuses_and_counts_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = spool_in(tmp_path, max_bytes=1024)
    fits = 1024 // (len(orjson.dumps(record("000"))) + 1)
    added = [record(f"{i:03d}") for i in range(fits)]
    assert all(spool.add(r) for r in added)
    with caplog.at_level("ERROR", logger="gateway.usage"):
        assert not spool.add(record("over"))
        assert not spool.add(record("over2"))
    assert spool.lost == 2
    assert spool.size_bytes() <= 1024
    assert lines_of(spool.path) == added
    assert sum("full" in r.getMessage() for r in caplog.records) == 2


async def test_a_flushed_spool_has_room_again(tmp_path: Path) -> None:
    spool = spool_in(tmp_path, max_bytes=1024)
    i = 0
    while spool.add(record(i)):
        i += 1
    assert spool.lost == 1
    assert await bounded(spool.flush(Recorder())) == i
    assert spool.add(record("again"))
    assert spool.lost == 1


def test_unwritable_directory_counts_lost(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    spool = spool_in(tmp_path / "a-file" / "spool")
    assert not spool.add(record(1))
    assert not spool.add(record(2))
    assert spool.lost == 2
    assert not spool.pending()


def test_an_unencodable_record_counts_lost(tmp_path: Path) -> None:
    spool = spool_in(tmp_path)
    assert not spool.add({**record(1), "user": "\ud800"})
    assert spool.lost == 1
    assert spool.add(record(2))


# --- flushing ----------------------------------------------------------------------------------


async def test_flush_sends_in_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("routing.ledger.spool.FLUSH_BATCH", 2)
    spool = spool_in(tmp_path)
    for i in range(5):
        spool.add(record(i))
    send = Recorder()
    assert await bounded(spool.flush(send)) == 5
    assert send.batches == [[f"{RID}0", f"{RID}1"], [f"{RID}2", f"{RID}3"], [f"{RID}4"]]
    assert not spool.pending()
    assert await bounded(spool.flush(send)) == 0


async def test_refused_records_stay_and_go_next_round(tmp_path: Path) -> None:
    spool = spool_in(tmp_path)
    for i in range(4):
        spool.add(record(i))
    send = Recorder(refuse={f"{RID}1", f"{RID}3"})
    assert await bounded(spool.flush(send)) == 2
    assert lines_of(spool.path) == [record(1), record(3)]
    send.refuse = set()
    assert await bounded(spool.flush(send)) == 2
    assert not spool.pending()
    assert send.batches == [[f"{RID}{i}" for i in range(4)], [f"{RID}1", f"{RID}3"]]


async def test_redis_going_away_mid_flush_keeps_what_was_not_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("routing.ledger.spool.FLUSH_BATCH", 2)
    spool = spool_in(tmp_path)
    for i in range(5):
        spool.add(record(i))
    with pytest.raises(RedisConnectionError):
        await bounded(spool.flush(Recorder(fail_after=1)))
    assert lines_of(spool.path) == [record(i) for i in (2, 3, 4)]
    with pytest.raises(RedisConnectionError):
        await bounded(spool.flush(Recorder(fail_after=0)))
    assert lines_of(spool.path) == [record(i) for i in (2, 3, 4)]


async def test_records_added_during_a_flush_stay(tmp_path: Path) -> None:
    spool = spool_in(tmp_path)
    spool.add(record(1))
    added_meanwhile = Recorder()

    async def send(calls: Sequence[Call]) -> list[Any]:
        spool.add(record(2))  # a release failing while the flush waits on Redis
        return await added_meanwhile(calls)

    assert await bounded(spool.flush(send)) == 1
    assert lines_of(spool.path) == [record(2)]


# --- torn and unreadable lines -----------------------------------------------------------------


async def test_a_torn_line_is_set_aside_and_the_rest_flushes(
    usage_redis: aioredis.Redis, tmp_path: Path
) -> None:
    spool = spool_in(tmp_path)
    spool.add(record(1))
    with spool.path.open("ab") as out:  # a kill during an append
        out.write(orjson.dumps(record("torn"))[:25])
    spool.add(record(2))  # starts on a line of its own
    with spool.path.open("ab") as out:
        out.write(b"\x00\xff not json\n[1, 2]\n" + orjson.dumps({"request_id": 7}) + b"\n")
    send = store_sender(Scripts(), RedisPyStore(usage_redis, 2.0))
    assert await bounded(spool.flush(send)) == 2
    assert spool.bad_lines == 4
    assert not spool.pending()
    entries = cast(StreamEntries, await usage_redis.xrange(USAGE_STREAM))
    stream = [data[b"request_id"] for _, data in entries]
    assert stream == [f"{RID}1".encode(), f"{RID}2".encode()]
    bad = spoolfile.bad_path(tmp_path, spool.store).read_bytes().splitlines()
    assert bad[0] == orjson.dumps(record("torn"))[:25]
    assert len(bad) == 4

    # The next round works, and a torn tail (nothing after it) is set aside too.
    spool.add(record(3))
    with spool.path.open("ab") as out:
        out.write(b'{"request_id": "t-sp')
    await bounded(spool.tend(send))
    assert spool.bad_lines == 5
    assert not spool.pending()
    assert len(cast(StreamEntries, await usage_redis.xrange(USAGE_STREAM))) == 3


async def test_an_overlong_line_is_set_aside_cut(tmp_path: Path) -> None:
    spool = spool_in(tmp_path)
    spool.add(record(1))
    with spool.path.open("ab") as out:
        out.write(b"x" * (spoolfile.MAX_LINE_BYTES * 3) + b"\n")
    spool.add(record(2))
    send = Recorder()
    assert await bounded(spool.flush(send)) == 2
    assert spool.bad_lines == 1
    bad = spoolfile.bad_path(tmp_path, spool.store)
    assert bad.stat().st_size <= spoolfile.MAX_LINE_BYTES + 2


async def test_the_bad_file_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("routing.ledger.spoolfile.BAD_MAX_BYTES", 100)
    spool = spool_in(tmp_path)
    spool.add(record(1))
    with spool.path.open("ab") as out:
        out.write(b"garbage-garbage-garbage-garbage\n" * 10)
    assert await bounded(spool.flush(Recorder())) == 1
    assert spool.bad_lines == 10
    assert spoolfile.bad_path(tmp_path, spool.store).stat().st_size <= 100


# --- adoption ----------------------------------------------------------------------------------


async def test_adopts_only_gone_processes_of_the_same_store(
    usage_redis: aioredis.Redis, tmp_path: Path
) -> None:
    gone = gone_process_spool(tmp_path, REDIS_URL, [f"{RID}g1", f"{RID}g2"])
    elsewhere = gone_process_spool(tmp_path, OTHER_URL, [f"{RID}x1"])
    alive = spool_in(tmp_path)  # this process, same store: alive, so never adopted
    alive.add(record("a1"))
    adopter = spool_in(tmp_path)
    send = store_sender(Scripts(), RedisPyStore(usage_redis, 2.0))

    assert await bounded(adopter.adopt(send)) == 2
    entries = cast(StreamEntries, await usage_redis.xrange(USAGE_STREAM))
    stream = [data[b"request_id"] for _, data in entries]
    assert stream == [f"{RID}g1".encode(), f"{RID}g2".encode()]
    assert not gone.exists() and not gone.with_suffix(".lock").exists()
    assert lines_of(elsewhere) == [
        {"request_id": f"{RID}x1", "account": "t-spool", "status": "200"}
    ]
    assert lines_of(alive.path) == [record("a1")]
    # Nothing left to adopt: a second round sends nothing again.
    assert await bounded(adopter.adopt(send)) == 0
    assert len(cast(StreamEntries, await usage_redis.xrange(USAGE_STREAM))) == 2


async def test_two_adopters_never_both_send_one_file(tmp_path: Path) -> None:
    rids = [f"{RID}{i}" for i in range(6)]
    for part in (rids[:3], rids[3:]):
        gone_process_spool(tmp_path, REDIS_URL, part)
    first, second = spool_in(tmp_path), spool_in(tmp_path)
    sends = Recorder(), Recorder()
    adopted = await bounded(asyncio.gather(first.adopt(sends[0]), second.adopt(sends[1])))
    assert sum(adopted) == 6
    assert sorted(sends[0].sent + sends[1].sent) == rids
    assert spool_files(tmp_path) == []


async def test_an_adoption_cut_short_leaves_the_rest_to_the_next_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("routing.ledger.spool.FLUSH_BATCH", 2)
    rids = [f"{RID}{i}" for i in range(5)]
    gone = gone_process_spool(tmp_path, REDIS_URL, rids)
    adopter = spool_in(tmp_path)
    with pytest.raises(RedisConnectionError):
        await bounded(adopter.adopt(Recorder(fail_after=1)))
    assert [r["request_id"] for r in lines_of(gone)] == rids[2:]
    later = spool_in(tmp_path)  # the lock was let go: any gateway of the store may finish
    send = Recorder()
    assert await bounded(later.adopt(send)) == 3
    assert send.sent == rids[2:]
    assert not gone.exists()


async def test_a_torn_line_in_an_adopted_spool_is_set_aside(tmp_path: Path) -> None:
    gone = gone_process_spool(tmp_path, REDIS_URL, [f"{RID}1"])
    with gone.open("ab") as out:  # killed during an append
        out.write(b'{"request_id": "t-spool-2", "acc')
    adopter = spool_in(tmp_path)
    send = Recorder()
    assert await bounded(adopter.adopt(send)) == 1
    assert send.sent == [f"{RID}1"]
    assert adopter.bad_lines == 1
    assert not gone.exists()


async def test_spools_awaiting_adoption_count_against_the_bound(tmp_path: Path) -> None:
    """A pod restarting in a loop while Redis is away: its predecessors' spools and its own
    together stay within spool_max_bytes (the emptyDir has a size limit)."""
    gone = gone_process_spool(tmp_path, REDIS_URL, [f"{RID}{i:03d}" for i in range(30)])
    line = len(orjson.dumps(record("000"))) + 1
    spool = spool_in(tmp_path, max_bytes=gone.stat().st_size + 3 * line)
    with pytest.raises(RedisConnectionError):
        await bounded(spool.tend(Recorder(fail_after=0)))  # Redis away: nothing adopted
    while spool.add(record(f"{spool.size_bytes() // line:03d}")):
        pass
    assert spool.size_bytes() == 3 * line
    assert spool.lost == 1


async def test_memory_spools_are_never_adopted(tmp_path: Path) -> None:
    gone = gone_process_spool(tmp_path, "memory://", [f"{RID}m1"])
    adopter = spool_in(tmp_path, "memory://")
    send = Recorder()
    await bounded(adopter.tend(send))
    assert send.sent == []
    assert [r["request_id"] for r in lines_of(gone)] == [f"{RID}m1"]
