"""Timing streamed completions from the client's side: a raw socket, the first `data:` byte
and the last byte (bench/overhead.py).

Each target's streams go over one kept-alive connection (`kept`, the default), as an OpenAI
SDK's do, and every hop keeps its own connections to the simulator: so no figure holds a
connection's set-up and "added" is what the hop adds to a stream. With a new connection
each (`new`, the figures before 2026-12-02), the straight run paid the simulator's accept of
every connection, which the hops, pooling theirs, did not: nginx's added TTFB read as low
as -0.085 ms, its noise, and the ratio to it was n/a or anything up to 93.

Until its first `data:` byte the client runs at a real-time priority (SCHED_FIFO, when the
process may: root or CAP_SYS_NICE), then at the normal one again. It shares its CPU with the
simulator, which at zero delays is busy writing the rest of its stream: at the normal
priority a client woken from the other CPU (by a hop pinned there, the gateway) waited for
the simulator to yield, about 0.6 ms here, while one woken by a hop on its own CPU (nginx)
was run at once. The first byte is timed when it arrives, not when the CPU is free; the
rest of the stream is read at the normal priority, so the total is not bought by starving
the simulator."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field

WARM_UP = 20  # streams per call not counted
PRIORITY = 10  # SCHED_FIFO's, until the first byte


@dataclass
class Timings:
    """Seconds, one entry per counted stream: to the first `data:` byte, to the last byte,
    and the widest gap between two reads after the first event."""

    firsts: list[float] = field(default_factory=list)
    totals: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {
            "ttfb_p50_ms": _p50_ms(self.firsts),
            "total_p50_ms": _p50_ms(self.totals),
            "widest_gap_p50_ms": _p50_ms(self.gaps),
            "streams": len(self.firsts),
        }


def _p50_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 3)


CONNECTIONS = ("kept", "new")
_LAST_CHUNK = b"\r\n0\r\n\r\n"  # the end of a chunked body


def request(host: str, path: str, body: bytes, key: str, connection: str = "kept") -> bytes:
    header = "keep-alive" if connection == "kept" else "close"
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nConnection: {header}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _prompt(on: bool) -> bool:
    """The calling thread at a real-time priority (on) or the normal one; False when the
    process may not change it."""
    try:
        if on:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(PRIORITY))
        else:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (PermissionError, AttributeError):
        return False
    return True


class _Client:
    """One target's connection: kept across its streams, or a new one for each (the
    request's `Connection` header says which); timed from the request's write."""

    def __init__(self, host: str, port: int, request: bytes) -> None:
        self._host, self._port, self._request = host, port, request
        self._kept = b"Connection: keep-alive" in request
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def one(self) -> tuple[float, float, float]:
        _prompt(True)
        try:
            return await self._read_one()
        finally:
            _prompt(False)

    async def _read_one(self) -> tuple[float, float, float]:
        start = time.perf_counter()
        if self._streams is None:  # always so for `new`; for `kept`, the first (warm-up) only
            self._streams = await asyncio.open_connection(self._host, self._port)
        reader, writer = self._streams
        writer.write(self._request)
        first = None
        last = start
        widest = 0.0
        data = b""
        closed = False
        while not (self._kept and data.endswith(_LAST_CHUNK) and b"[DONE]" in data):
            chunk = await reader.read(65536)
            if not chunk:
                closed = True
                break
            now = time.perf_counter()
            data += chunk
            if first is None and b"data:" in data:
                first = now
                _prompt(False)
            elif first is not None:
                widest = max(widest, now - last)
            last = now
        if not self._kept or closed:
            writer.close()
            self._streams = None
        if b"[DONE]" not in data:
            raise RuntimeError(f"stream did not finish: {data[-300:]!r}")
        return (first or last) - start, last - start, widest

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


async def _timed(host: str, port: int, request: bytes, n: int, into: Timings) -> None:
    client = _Client(host, port, request)
    try:
        for i in range(n + WARM_UP):
            first, total, widest = await client.one()
            if i >= WARM_UP:
                into.firsts.append(first)
                into.totals.append(total)
                into.gaps.append(widest)
    finally:
        client.close()


def prompt_client() -> bool:
    """Whether the client can wait for first bytes at a real-time priority here."""
    able = _prompt(True)
    _prompt(False)
    return able


def time_streams(
    host: str, port: int, request: bytes, n: int, into: Timings, cpu: int | None = None
) -> None:
    """n sequential streams (after WARM_UP more), their timings added to `into`; the client
    pinned to `cpu` meanwhile (None: where it runs)."""
    before = os.sched_getaffinity(0)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    try:
        asyncio.run(_timed(host, port, request, n, into))
    finally:
        os.sched_setaffinity(0, before)
