"""Timing streamed completions from the client's side: a raw socket, a new connection each,
the first `data:` byte and the last byte (bench/overhead.py)."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

WARM_UP = 20  # streams per call not counted


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


def request(host: str, path: str, body: bytes, key: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _one(host: str, port: int, request: bytes) -> tuple[float, float, float]:
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request)
    first = None
    last = start
    widest = 0.0
    data = b""
    while chunk := await reader.read(65536):
        now = time.perf_counter()
        data += chunk
        if first is None and b"data:" in data:
            first = now
        elif first is not None:
            widest = max(widest, now - last)
        last = now
    writer.close()
    if b"[DONE]" not in data:
        raise RuntimeError(f"stream did not finish: {data[-300:]!r}")
    return (first or last) - start, last - start, widest


async def _timed(host: str, port: int, request: bytes, n: int, into: Timings) -> None:
    for i in range(n + WARM_UP):
        first, total, widest = await _one(host, port, request)
        if i >= WARM_UP:
            into.firsts.append(first)
            into.totals.append(total)
            into.gaps.append(widest)


def time_streams(host: str, port: int, request: bytes, n: int, into: Timings) -> None:
    """n sequential streams (after WARM_UP more), their timings added to `into`."""
    asyncio.run(_timed(host, port, request, n, into))
