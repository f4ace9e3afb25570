"""A py-spy profile of the gateway at c=32 (bench/overhead.py --profile SECONDS): py-spy's raw
(collapsed) stacks, and where the samples went by part of the stack. py-spy is not a
dependency: `.venv/bin/python -m pip install py-spy` (it needs ptrace rights on the gateway)."""

from __future__ import annotations

import collections
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import harness

# A stack's first path component (or top-level module) -> the part it belongs to.
PARTS = {
    "aiohttp": "aiohttp (the hop to workers)",
    "multidict": "aiohttp (the hop to workers)",
    "yarl": "aiohttp (the hop to workers)",
    "aiohappyeyeballs": "aiohttp (the hop to workers)",
    "propcache": "aiohttp (the hop to workers)",
    "uvicorn": "uvicorn + httptools",
    "httptools": "uvicorn + httptools",
    "h11": "uvicorn + httptools",
    "starlette": "starlette",
    "hiredis": "the Redis client",
    "prometheus_client": "prometheus-client",
    "pydantic": "pydantic",
    "pydantic_core": "pydantic",
    "gateway": "the gateway's own Python",
    "tiers": "the gateway's own Python",
    "routing": "the gateway's own Python",
    "uvloop": "the event loop",
}
# The loop's own dispatch: a sample whose innermost known frame is one of these is the loop's.
LOOP_FILES = ("asyncio/events.py", "asyncio/base_events.py", "asyncio/runners.py")
# routing/store/ now; routing/ as they were in older trees (a baseline's profile).
_STORE = ("resp", "wire", "store", "cluster", "slotmap", "sentinel")
REDIS_FILES = (
    *(f"routing/store/{name}.py" for name in (*_STORE, "base", "connect", "probe")),
    *(f"routing/{name}.py" for name in _STORE),
)
OTHER = "other (stdlib, interpreter)"


def part(frame: str) -> str | None:
    """The part a frame `func (path:line)` belongs to; None for stdlib frames (they count
    for their caller)."""
    path = frame.rsplit("(", 1)[-1].split(":", 1)[0]
    if path.startswith(LOOP_FILES):
        return "the event loop"
    if path.startswith(REDIS_FILES):
        return "the Redis client"
    return PARTS.get(path.split("/", 1)[0].removesuffix(".py"))


def by_part(raw: str) -> dict[str, float]:
    """Share of samples (%) per part, each sample given to the innermost frame of a known
    part, from py-spy's raw output (`frame;frame;... count` per line, outermost first)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        found = next((p for f in reversed(frames) if (p := part(f)) is not None), OTHER)
        counts[found] += int(n)
    total = sum(counts.values()) or 1
    return {name: round(100 * n / total, 1) for name, n in counts.most_common()}


def top_self(raw: str, n: int = 15) -> list[tuple[str, float]]:
    """The n innermost frames (function and file, lines merged) holding most samples, in %."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            leaf = stack.split(";")[-1]
            counts[leaf.rsplit(":", 1)[0] + ")"] += int(count)
    total = sum(counts.values()) or 1
    return [(frame, round(100 * c / total, 1)) for frame, c in counts.most_common(n)]


def record(gw: harness.Proc, script: Path, seconds: int, out: Path) -> dict[str, Any]:
    """py-spy on the gateway (500 Hz, not pausing it) while wrk runs c=32 against it."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        sys.exit("--profile needs py-spy: .venv/bin/python -m pip install py-spy")
    args = [spy, "record", "-p", str(gw.popen.pid), "-r", "500", "-d", str(seconds),
            "-f", "raw", "-o", str(out), "--nonblocking"]  # fmt: skip
    with subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as sampler:
        run = harness.wrk(gw.url + "/v1/completions", script, 32, seconds + 1)
        _, err = sampler.communicate(timeout=30)
    if sampler.returncode != 0:
        sys.exit(f"py-spy failed: {err.decode()[-1000:]}")
    raw = out.read_text()
    return {"seconds": seconds, "rps": round(run.rps), "stacks": str(out),
            "by_part_pct": by_part(raw), "top_self_pct": top_self(raw)}  # fmt: skip


def print_profile(found: dict[str, Any]) -> None:
    print(f"profile at c=32, {found['seconds']} s, {found['rps']} req/s under py-spy:")
    for name, pct in found["by_part_pct"].items():
        print(f"  {pct:5.1f} %  {name}")
    print("  innermost frames:")
    for frame, pct in found["top_self_pct"]:
        print(f"  {pct:5.1f} %  {frame}")
    print(f"  stacks: {found['stacks']}")
