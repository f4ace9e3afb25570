"""`gateway demo` under a burst (issue 11, item 6): its in-process store (memory://) answers a
thousand requests at once, so `fail_fast` callers get a 200 or a 429, never a 503."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from pathlib import Path

import aiohttp

from tests.e2e import procs
from tests.redis_server import free_port

BURST = 1000


def _demo_key(demo: procs.Proc) -> str:
    # The banner comes once every server of the demo listens, maybe after /healthz answers.
    deadline = time.monotonic() + 15
    while (found := re.search(r"demo key: (\S+)", demo.log.read_text())) is None:
        assert time.monotonic() < deadline, demo.log.read_text()[-2000:]
        time.sleep(0.05)
    return found.group(1)


async def _burst(url: str, key: str) -> Counter[int]:
    body = {
        "model": "demo/llama-3-8b",
        "messages": [{"role": "user", "content": "Hello!"}],
        "fail_fast": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    codes: Counter[int] = Counter()
    connector = aiohttp.TCPConnector(limit=0)  # all at once, one connection each
    timeout = aiohttp.ClientTimeout(total=90)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> None:
            async with session.post(url, json=body, headers=headers) as response:
                await response.read()
                codes[response.status] += 1

        await asyncio.gather(*(one() for _ in range(BURST)))
    return codes


def test_a_thousand_concurrent_fail_fast_requests_get_200_or_429(tmp_path: Path) -> None:
    port = free_port()
    demo = procs.Proc(["demo", "--port", str(port)], port, "/healthz", tmp_path / "demo.log")
    demo.start()
    try:
        key = _demo_key(demo)
        codes = asyncio.run(_burst(demo.url + "/v1/chat/completions", key))
    finally:
        demo.stop()
    assert sum(codes.values()) == BURST
    assert set(codes) <= {200, 429}, codes
    assert codes[200] >= 1, codes
    assert "redis:" not in demo.log.read_text()  # no store error of any kind was met
