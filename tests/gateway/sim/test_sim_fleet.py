"""`gateway sim --endpoints N`: many simulated workers in one process, one per port, each
with its own slots and counters, run for real under uvicorn on loopback sockets."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest
import uvicorn

from gateway.edge.listen import listen
from gateway.sim import SimOptions
from gateway.sim.fleet import MAX_ENDPOINTS, SimFleet

ROUNDS = 500


async def test_each_port_is_a_worker_of_its_own() -> None:
    socks = [listen("127.0.0.1", 0) for _ in range(3)]
    ports = [s.getsockname()[1] for s in socks]
    options = SimOptions(models=("m",), max_seqs=1, ttft_ms=0, itl_ms=0, tokens=2)
    config = uvicorn.Config(SimFleet(options, ports), lifespan="on", log_config=None,
                            access_log=False, http="httptools", ws="none")  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=socks))
    try:
        for _ in range(ROUNDS):
            if server.started:
                break
            await asyncio.sleep(0.01)
        assert server.started
        async with httpx.AsyncClient(timeout=5.0) as http:
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            for port, times in zip(ports, (0, 2, 1), strict=True):
                for _ in range(times):
                    answer = await http.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                    assert answer.status_code == 200
            spans = [
                len((await http.get(f"http://127.0.0.1:{port}/sim/peak")).json()["spans"])
                for port in ports
            ]
        assert spans == [0, 2, 1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        for sock in socks:
            sock.close()


def test_the_fleet_size_is_bounded() -> None:
    with pytest.raises(ValueError, match="endpoints"):
        SimFleet(SimOptions(), [])
    with pytest.raises(ValueError, match="endpoints"):
        SimFleet(SimOptions(), range(1, MAX_ENDPOINTS + 2))


@pytest.mark.parametrize(
    ("args", "says"),
    [(["--endpoints", "0"], "from 1 to"), (["--endpoints", "x"], "not a number"),
     (["--port", "65535", "--endpoints", "2"], "needs ports 65535 to 65536"),
     (["--kv-tokens", "8"], "at least one block"), (["--max-seqs", "0"], "at least 1")],
)  # fmt: skip
def test_the_cli_refuses_a_fleet_it_cannot_serve(args: list[str], says: str) -> None:
    argv = [sys.executable, "-m", "gateway", "sim", "--port", "1", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert says in done.stderr
