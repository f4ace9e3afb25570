"""Stopping `gateway serve` while a request is still being read: a second signal, SIGTERM
as well as SIGINT, forces the stop (uvicorn forced on SIGINT only: a second SIGTERM drained
on for the whole grace), and the request cut while its body was arriving is told
`shutting_down` (it got a bare 500 and its CancelledError a traceback in the log)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e import procs
from tests.e2e.conftest import digest

KEY = "sk-stop"
SLACK_S = 10.0  # a busy 2-core CI machine


def _config() -> str:
    # No worker is needed: the request never gets past its body.
    return (
        'redis: {url: "memory://"}\n'
        "shutdown_grace_s: 60\n"
        "models: {m: {endpoints: [{url: 'http://127.0.0.1:9', max_concurrency: 1}]}}\n"
        f'keys: [{{sha256: "{digest(KEY)}", account: a, max_concurrency: 5}}]\n'
    )


async def _logged(log: Path, line: str) -> None:
    """Until `line` is in the log (another process's file has no event: polled)."""
    deadline = time.monotonic() + SLACK_S
    while line not in (text := await asyncio.to_thread(log.read_text)):
        assert time.monotonic() < deadline, text[-2000:]
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
async def test_a_second_signal_cuts_a_request_whose_body_is_still_arriving(
    tmp_path: Path, second: signal.Signals
) -> None:
    gateway = procs.gateway(tmp_path, _config())
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: 100\r\n\r\n"
            b'{"model": '
        )
        await writer.drain()
        async with httpx.AsyncClient() as client:  # answered after the request above was read
            assert (await client.get(gateway.url + "/healthz")).status_code == 200
        assert gateway.popen is not None
        gateway.popen.send_signal(signal.SIGTERM)
        await _logged(gateway.log, "stopping: draining")
        gateway.popen.send_signal(second)
        answer = await asyncio.wait_for(reader.read(), SLACK_S)
        writer.close()
        assert gateway.popen.wait(timeout=SLACK_S) == 0
    finally:
        gateway.stop(signal.SIGKILL)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer
    assert b'"code":"shutting_down"' in body.replace(b" ", b""), answer
    log = gateway.log.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
