"""The ACL user docs/redis.md gives is enough, and nothing more is needed: a gateway whose
Redis user has exactly that rule (read from the document) starts, admits past capacity
(queue, wake-ups, releases with usage records), takes a key minted with `gateway keys
create`, and `gateway usage export` reads every record; nothing is left held afterwards."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import redis

from tests.e2e import procs
from tests.redis_server import RedisServer

DOC = Path(__file__).resolve().parents[2] / "docs" / "redis.md"
PASSWORD = "acl-pass-7"  # the test's own throwaway Redis
REQUESTS = 12
CAPACITY = 2


def documented_rule() -> list[str]:
    """The words after `ACL SETUSER gateway` in the document, with the password filled in."""
    found = re.findall(r"^ACL SETUSER gateway (.+)$", DOC.read_text(encoding="utf-8"), re.M)
    assert len(found) == 1, "docs/redis.md gives one ACL SETUSER line"
    return [word.replace("PASSWORD", PASSWORD) for word in found[0].split()]


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[tuple[RedisServer, str]]:
    server = RedisServer(tmp_path).start()
    try:
        with redis.Redis(port=server.port) as admin:
            admin.execute_command("ACL", "SETUSER", "gateway", *documented_rule())
        yield server, f"redis://gateway:{PASSWORD}@127.0.0.1:{server.port}/0"
    finally:
        server.stop()


def run_cli(tmp: Path, config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args, "--config", str(config)],
        capture_output=True, text=True, timeout=60, cwd=tmp,
    )  # fmt: skip


def ask(client: openai.OpenAI, i: int) -> str:
    if i % 2:
        chunks = client.completions.create(model="m", prompt=f"acl {i}", max_tokens=4, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)
    answer = client.completions.create(model="m", prompt=f"acl {i}", max_tokens=4)
    return answer.choices[0].text


def test_the_documented_acl_is_all_the_gateway_needs(
    acl_redis: tuple[RedisServer, str], tmp_path: Path
) -> None:
    server, url = acl_redis
    worker = procs.sim(tmp_path, "--ttft-ms", "100", "--itl-ms", "10")
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f'redis: {{url: "{url}"}}\n'
        f"models:\n  m: {{max_queue: {REQUESTS}, endpoints: "
        f'[{{url: "{worker.url}", max_concurrency: {CAPACITY}, model: m1}}]}}\n'
    )
    try:
        minted = run_cli(tmp_path, config, "keys", "create", "--account", "acl", "--weight", "2")
        assert minted.returncode == 0, minted.stderr
        key = minted.stdout.strip()
        gateway = procs.gateway(tmp_path, config.read_text())
        try:
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
            # past capacity: some wait for a wake-up
            with client, ThreadPoolExecutor(REQUESTS) as pool:
                answers = list(pool.map(lambda i: ask(client, i), range(REQUESTS)))
            assert all(answers)
        finally:
            assert gateway.stop() == 0
        # A refused command inside a script may heal by itself (sweeps, give-backs) and
        # leave every answer right: the log is where it shows.
        problems = [line for line in gateway.log.read_text().splitlines() if "ERROR" in line]
        assert problems == []
        exported = run_cli(tmp_path, config, "usage", "export")
        assert exported.returncode == 0, exported.stderr
    finally:
        worker.stop()
    records = [json.loads(line) for line in exported.stdout.splitlines()]
    assert len(records) == REQUESTS
    assert {(r["account"], r["status"], r["outcome"]) for r in records} == {
        ("acl", 200, "complete")
    }
    with redis.Redis(port=server.port) as admin:
        assert admin.zcard("gw:v2:{m}:leases") == 0
        assert admin.zcard("gw:v2:{m}:queue") == 0
        # Fair share's account queues, index and held counts go with the last waiter.
        assert admin.keys("gw:v2:{m}:f[qi]:*") == [] and not admin.exists("gw:v2:{m}:held")
        (stored,) = admin.hvals("gw:keys")
        assert json.loads(stored)["weight"] == 2
