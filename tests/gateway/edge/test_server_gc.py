"""What a started server relies on, checked on the real route and the server's own protocol
over the run's Redis and a real simulated worker: a request leaves no reference cycle
behind (gateway/edge/server.py `settle_gc` freezes the collector's old objects and raises its
thresholds), and no thread is started (metrics change without a lock: gateway/metrics.py
`LoopValue`)."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.app.front import build_app
from gateway.edge.server import GC_THRESHOLDS, _DrainingServer, server_config, settle_gc
from gateway.runtime.settings import parse_config
from gateway.runtime.state import GatewayState
from tests import conftest
from tests.e2e import procs

KEY = "sk-gc-test"
REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
    b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: %d\r\n\r\n%s"
)
BODY = b'{"model": "m1", "prompt": "hello", "max_tokens": 2}'


@pytest.fixture
def collector() -> Iterator[None]:
    """The test process's collector as it was, whatever the test did to it."""
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        gc.set_debug(0)
        gc.garbage.clear()


def test_settle_gc_freezes_what_is_there_and_raises_the_thresholds(collector: None) -> None:
    settle_gc()
    assert gc.get_threshold() == GC_THRESHOLDS
    assert gc.get_freeze_count() > 0
    assert GC_THRESHOLDS[0] > 700  # above CPython's own, or the change does nothing


def _config(sim: procs.Proc) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
redis: {{url: "{conftest.REDIS_URL}", lease_ttl_s: 30}}
models:
  m1: {{endpoints: [{{url: "{sim.url}", max_concurrency: 64}}]}}
keys: [{{sha256: "{digest}", account: gc, max_concurrency: 1000}}]
"""


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(REQUEST % (len(BODY), BODY))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    await asyncio.wait_for(reader.readexactly(length), 10)
    return head


async def test_requests_on_a_started_server_leave_no_cycle_behind(
    collector: None, real_redis: aioredis.Redis, tmp_path: Path
) -> None:
    sim = procs.sim(tmp_path, "--ttft-ms", "0", "--itl-ms", "0", "--tokens", "4")
    try:
        await _serve_requests(sim)
    finally:
        sim.stop()


async def _serve_requests(sim: procs.Proc) -> None:
    state = GatewayState(parse_config(_config(sim), "gc.yaml"))
    server = _DrainingServer(server_config(build_app(state), grace_s=5), None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    threads = threading.active_count()
    task = asyncio.get_running_loop().create_task(server.serve([sock]))
    try:
        for _ in range(200):  # uvicorn has no started event to wait on
            if server.started or task.done():
                break
            await asyncio.sleep(0.05)
        assert server.started
        assert gc.get_threshold() == GC_THRESHOLDS  # the started server settled the collector
        connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        for reader, writer in connections:  # warm: pools, metric children, scripts loaded
            assert (await _answer(reader, writer)).startswith(b"HTTP/1.1 200 ")
        await state.admission.drain()
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the next collection finds stays to be seen
        for _ in range(50):
            heads = await asyncio.gather(*(_answer(r, w) for r, w in connections))
            assert all(head.startswith(b"HTTP/1.1 200 ") for head in heads)
        await state.admission.drain()
        # Metrics change without a lock (gateway/metrics.py LoopValue): on this thread only.
        assert threading.active_count() == threads
        found = gc.collect()
        kinds = sorted({type(o).__name__ for o in gc.garbage})
        # 200 requests, each of some hundred objects: a cycle per request would be 200+.
        assert found < 20, kinds
        for _, writer in connections:
            writer.close()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()
