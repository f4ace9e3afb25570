"""A misconfigured store is named, never "unreachable" (issue 11, item 9), on real servers
this test starts: a wrong password, a user without a permission the gateway needs, a
self-signed TLS certificate the client has no CA for, a Sentinel port given as a redis://
URL (redis+sentinel:// is the way: tests/e2e/test_sentinel.py), a master name the sentinels
do not know, and a replica.

`gateway serve` refuses to start with one line on stderr and exit code 2; a gateway already
running answers /readyz with a 503 naming the cause; a password changed under a running
gateway is logged by cause, not on every retry. A Redis that is merely unreachable at start
does not stop the start (an outage may heal; `redis.on_outage` answers meanwhile)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from gateway.app.front import build_app
from gateway.runtime.settings import parse_config
from gateway.runtime.state import GatewayState
from routing.store.probe import start_problem
from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.redis_server import RedisServer, free_port, self_signed

KEY = "sk-store-causes"


def config(url: str, endpoint: str = "http://127.0.0.1:9") -> str:
    # Health probes far apart: the endpoint's state is not what these tests look at.
    return f"""
redis: {{url: "{url}", command_timeout_s: 1}}
health: {{interval_s: 60, unhealthy_after: 5}}
models:
  m: {{endpoints: [{{url: "{endpoint}", max_concurrency: 4, model: m1}}]}}
keys: [{{sha256: "{digest(KEY)}", account: causes}}]
"""


@dataclass
class Misconfigured:
    url: str
    reason: str  # the one line, as `serve` says it at start and the log says it
    public: str  # as /readyz tells anyone who asks: no address, user or topology
    servers: list[RedisServer] = field(default_factory=list)


def wrong_password(tmp: Path) -> Misconfigured:
    server = RedisServer(tmp, extra=["--requirepass", "the-right-one"]).start()
    url = server.url.replace("//", "//:a-wrong-one@")
    reason = "redis: WRONGPASS invalid username-password pair or user is disabled."
    return Misconfigured(url, reason, "redis: WRONGPASS (wrong or missing password)", [server])


def missing_permission(tmp: Path) -> Misconfigured:
    server = RedisServer(tmp).start()
    with redis.Redis(port=server.port) as admin:  # everything but running scripts, either way
        admin.execute_command("ACL", "SETUSER", "gw", "on", ">pw", "~*", "&*", "+@all",
                              "-evalsha", "-fcall")  # fmt: skip
    url = f"redis://gw:pw@127.0.0.1:{server.port}/0"
    reason = "redis: NOPERM this user has no permissions to run the 'evalsha' command"
    return Misconfigured(url, reason, "redis: NOPERM (missing ACL permission: evalsha)", [server])


def self_signed_tls(tmp: Path) -> Misconfigured:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl binary makes the test's certificate; it is not installed")
    server = RedisServer(tmp, tls=self_signed(tmp))
    try:
        server.start()
    except RuntimeError as exc:  # Debian's redis-server has TLS; a build without it does not
        if "tls" not in str(exc).lower():
            raise
        pytest.skip(f"this redis-server has no TLS: {exc}")
    reason = "redis: TLS certificate verify failed: self-signed certificate"
    return Misconfigured(server.url, reason, reason, [server])  # rediss:// without ssl_ca_certs


def sentinel_port(tmp: Path) -> Misconfigured:
    server = RedisServer(tmp, sentinel=True).start()
    reason = "redis: not a master (sentinel)"
    return Misconfigured(server.url, reason, reason, [server])


def unknown_master(tmp: Path) -> Misconfigured:
    master = RedisServer(tmp).start()
    server = RedisServer(tmp, sentinel=True, monitor=master.port).start()  # it watches "gw"
    url = f"redis+sentinel://127.0.0.1:{server.port}/not-gw"
    reason = "redis: the sentinels know no master named 'not-gw'"
    public = "redis: the sentinels know no master of that name"
    return Misconfigured(url, reason, public, [server, master])


def replica(tmp: Path) -> Misconfigured:
    master = RedisServer(tmp).start()
    server = RedisServer(tmp, extra=["--replicaof", "127.0.0.1", str(master.port)]).start()
    reason = f"redis: not a master (replica of 127.0.0.1:{master.port})"
    return Misconfigured(server.url, reason, "redis: not a master (replica)", [master, server])


@pytest.fixture(params=[wrong_password, missing_permission, self_signed_tls, sentinel_port,
                        unknown_master, replica])  # fmt: skip
def misconfigured(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Misconfigured]:
    build: Callable[[Path], Misconfigured] = request.param
    made = build(tmp_path)
    try:
        yield made
    finally:
        for server in made.servers:
            server.stop()


def test_serve_refuses_to_start_with_one_line(misconfigured: Misconfigured, tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(config(misconfigured.url))
    port = str(free_port())
    ran = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", port],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.splitlines() == [f"gateway: {misconfigured.reason}"]


async def test_readyz_names_the_cause(misconfigured: Misconfigured) -> None:
    state = GatewayState(parse_config(config(misconfigured.url), "causes.yaml"))
    await asyncio.wait_for(state.start(), 10)
    try:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            ready = await asyncio.wait_for(http.get("/readyz"), 10)
            headers = {"Authorization": f"Bearer {KEY}"}
            body = {"model": "m", "prompt": "x", "max_tokens": 1}
            refused = await asyncio.wait_for(
                http.post("/v1/completions", json=body, headers=headers), 10
            )
    finally:
        await asyncio.wait_for(state.close(), 15)
    assert ready.status_code == 503
    assert ready.json() == {"status": "unavailable", "reason": misconfigured.public}
    assert refused.status_code == 503


def test_an_unreachable_store_at_start_is_an_outage_not_a_misconfiguration() -> None:
    assert start_problem(f"redis://127.0.0.1:{free_port()}/0", 0.5) is None
    # No sentinel answering is the same: an outage, which may heal.
    assert start_problem(f"redis+sentinel://127.0.0.1:{free_port()}/gw", 0.5) is None


def test_a_password_changed_under_a_running_gateway_is_named_once(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, extra=["--requirepass", "old"]).start()
    started: list[procs.Proc] = []
    try:
        sim = procs.sim(tmp_path, "--ttft-ms", "0", "--itl-ms", "0", "--tokens", "2")
        started.append(sim)
        gw = procs.gateway(tmp_path, config(server.url.replace("//", "//:old@"), sim.url))
        started.append(gw)
        headers = {"Authorization": f"Bearer {KEY}"}
        body = {"model": "m", "prompt": "x", "max_tokens": 1}
        with httpx.Client(base_url=gw.url, headers=headers, timeout=30) as http:
            assert http.post("/v1/completions", json=body).status_code == 200
            with redis.Redis(port=server.port, password="old") as admin:
                admin.config_set("requirepass", "new")
            with redis.Redis(port=server.port, password="new") as admin:
                admin.client_kill_filter(_type="normal", skipme=True)
                admin.client_kill_filter(_type="pubsub")
            reason = _await_unready(http)
            assert reason == "redis: WRONGPASS (wrong or missing password)"
            codes = [http.post("/v1/completions", json=body).status_code for _ in range(30)]
            assert set(codes) == {503}
        log = gw.log.read_text()
        # Thirty refused requests, a sweep a second, a subscription retrying: a line or two
        # (this test takes seconds; the next line would come a minute after the first).
        assert 1 <= log.count("WRONGPASS") <= 2, log[-3000:]
    finally:
        for proc in started:
            proc.stop()
        server.stop()


def _await_unready(http: httpx.Client) -> str:
    deadline = time.monotonic() + 15
    while True:
        ready = http.get("/readyz")
        if ready.status_code == 503:
            reason: str = ready.json()["reason"]
            return reason
        assert time.monotonic() < deadline, "/readyz stayed 200"
        time.sleep(0.05)


@pytest.mark.parametrize(
    "command", [["keys", "create", "--account", "a"], ["usage", "export"]], ids=["keys", "usage"]
)
def test_the_operator_commands_name_the_cause(tmp_path: Path, command: list[str]) -> None:
    made = wrong_password(tmp_path)
    try:
        path = tmp_path / "gateway.yaml"
        path.write_text(config(made.url))
        ran = subprocess.run(
            [sys.executable, "-m", "gateway", *command, "--config", str(path)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        made.servers[0].stop()
    assert ran.returncode == 1, ran.stderr
    assert ran.stderr.splitlines() == [f"gateway {' '.join(command[:2])}: {made.reason}"]
