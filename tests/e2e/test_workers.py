"""`gateway serve --workers 2` from outside: requests spread over both processes, `/metrics`
counts each request once whichever process answers the scrape (also after a worker was
killed and started again), SIGTERM drains both (streams in flight end whole, the serve
exits 0, Redis keeps no lease or waiter and has one usage record per request), a changed
config reaches both, and the records a killed worker spooled reach Redis once.

Which process served a request is read from the access log (`--log-format json` carries
each line's pid under `--workers`). Each request here opens its own connection, since the
kernel spreads connections, not requests, over the workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.redis_server import RedisServer, endpoint_load

KEY = "sk-workers"
AUTH = {"Authorization": f"Bearer {KEY}"}
RUN = uuid.uuid4().hex[:8]
STREAMS = 16  # in flight at SIGTERM: all on one of two workers by chance once in 2**15
WARM_UP_MAX = 200  # requests, at most, until both workers have answered one


def config(sim: procs.Proc, redis_url: str, spool_dir: Path) -> str:
    return (
        # local: the spool test serves through a Redis outage.
        f'redis: {{url: "{redis_url}", lease_ttl_s: 5, on_outage: local}}\n'
        f'usage: {{spool_dir: "{spool_dir}"}}\n'
        "models:\n  m:\n"
        f'    endpoints: [{{url: "{sim.url}", max_concurrency: {STREAMS + 4}, model: m1}}]\n'
        f'keys: [{{sha256: "{digest(KEY)}", account: workers}}]\n'
    )


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[procs.Proc]:
    tmp = tmp_path_factory.mktemp("workers-sim")
    # Streams of about 2 s: still running when the serve gets its SIGTERM.
    worker = procs.sim(
        tmp, "--ttft-ms", "0", "--itl-ms", "100", "--tokens", "20", "--max-seqs", str(STREAMS + 4)
    )
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def serve(sim: procs.Proc, store: RedisServer, tmp_path: Path) -> Iterator[procs.Proc]:
    text = config(sim, store.url, tmp_path / "spool")
    gateway = procs.gateway(
        tmp_path, text, "--workers", "2", "--access-log", "--log-format", "json", group=True
    )
    try:
        yield gateway
    finally:
        gateway.stop()


def complete(gateway: procs.Proc, rid: str) -> int:
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    headers = {**AUTH, "x-request-id": rid}
    url = gateway.url + "/v1/completions"
    return httpx.post(url, json=body, headers=headers, timeout=30).status_code


def served_by(gateway: procs.Proc) -> dict[str, int]:
    """request id -> pid of the process that logged it, from the access log."""
    found: dict[str, int] = {}
    for line in gateway.log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        if entry.get("logger") == "gateway.access" and entry.get("path") == "/v1/completions":
            found[entry["request_id"]] = entry["pid"]
    return found


def wait_for_log(gateway: procs.Proc, rids: list[str]) -> dict[str, int]:
    """The access lines of `rids` (each written as its request ends), bounded in time."""
    deadline = time.monotonic() + 20
    while not set(rids) <= (seen := served_by(gateway)).keys():
        assert time.monotonic() < deadline, "access log lines missing"
        time.sleep(0.05)
    return {rid: seen[rid] for rid in rids}


def warm_up(gateway: procs.Proc, name: str) -> list[str]:
    """Requests until both workers have served one (the second may still be starting)."""
    rids: list[str] = []
    while len(set(wait_for_log(gateway, rids).values())) < 2:
        assert len(rids) < WARM_UP_MAX, "every request went to one worker"
        rid = f"workers-{RUN}-{name}-{len(rids)}"
        assert complete(gateway, rid) == 200
        rids.append(rid)
    return rids


def requests_counted(gateway: procs.Proc) -> float:
    """gateway_requests_total of model m summed, as one scrape (one connection) shows it."""
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gateway_requests_total{") and 'model="m"' in line
    )


def recorded(store: RedisServer) -> Counter[str]:
    with redis.Redis.from_url(store.url) as client:
        return Counter(d[b"request_id"].decode() for _, d in client.xrange("usage"))


def left_in_redis(store: RedisServer) -> list[str]:
    """What admission still holds: leases, waiters, endpoint loads, account entries."""
    found: list[str] = []
    with redis.Redis.from_url(store.url) as client:
        tag = "gw:v2:{m}:"
        found += [f"{tag}{k}" for k in ("leases", "queue", "qexp") if client.zcard(tag + k)]
        if client.hlen(tag + "ep_of"):
            found.append(f"{tag}ep_of")
        if endpoint_load(client.hgetall(tag + "ep_load")):
            found.append(f"{tag}ep_load")
        found += [k.decode() for k in client.scan_iter(match="gw:v2:acct:*") if client.zcard(k)]
    return found


def test_requests_spread_over_both_workers_and_metrics_count_each_once(
    serve: procs.Proc, store: RedisServer
) -> None:
    rids = warm_up(serve, "spread")
    rids += [f"workers-{RUN}-spread-more-{i}" for i in range(20)]
    assert [complete(serve, rid) for rid in rids[-20:]] == [200] * 20
    by_pid = Counter(wait_for_log(serve, rids).values())
    assert len(by_pid) == 2 and sum(by_pid.values()) == len(rids)
    # Scrapes on their own connections land on either worker: each shows every request.
    assert [requests_counted(serve) for _ in range(6)] == [len(rids)] * 6

    # A worker killed is started again; what it counted stays counted.
    victim = next(iter(by_pid))
    serve_pid = serve.popen.pid if serve.popen else 0
    assert victim != serve_pid
    os.kill(victim, signal.SIGKILL)
    # Once reaped its socket is closed: no new connection can land in its backlog.
    deadline = time.monotonic() + 20
    while f"worker {victim} was killed" not in serve.log.read_text():
        assert time.monotonic() < deadline, "the parent never saw its worker die"
        time.sleep(0.05)
    more = warm_up(serve, "after-kill")
    assert victim not in wait_for_log(serve, more).values()
    rids += more
    assert [requests_counted(serve) for _ in range(6)] == [len(rids)] * 6
    assert recorded(store) == Counter(rids)


def stream(gateway: procs.Proc, rid: str, started: threading.Barrier) -> tuple[int, bytes]:
    body = {"model": "m", "prompt": "x", "stream": True}
    headers = {**AUTH, "x-request-id": rid}
    url = gateway.url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as response:
        chunks = response.iter_bytes()
        first = next(chunks)
        started.wait(timeout=30)
        return response.status_code, first + b"".join(chunks)


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigterm", "ctrl-c"])
def test_sigterm_drains_both_workers(serve: procs.Proc, store: RedisServer, ctrl_c: bool) -> None:
    """SIGTERM to the serve, or a terminal's Ctrl-C (SIGINT to every process of the group):
    each worker then gets the stop twice, directly and from its parent, which is still one
    stop (it was a forced one, cutting the streams short at once)."""
    rids = warm_up(serve, "drain-warm")
    streams = [f"workers-{RUN}-drain-{ctrl_c:d}-{i}" for i in range(STREAMS)]
    started = threading.Barrier(STREAMS + 1)
    with ThreadPoolExecutor(STREAMS) as pool:
        answers = [pool.submit(stream, serve, rid, started) for rid in streams]
        started.wait(timeout=30)  # every stream has its first bytes: all in flight
        if ctrl_c:
            serve.signal_group(signal.SIGINT)
            assert serve.popen is not None and serve.popen.wait(timeout=30) == 0
        else:
            assert serve.stop(signal.SIGTERM) == 0
        results = [a.result(timeout=30) for a in answers]
    assert all(code == 200 and body.rstrip().endswith(b"data: [DONE]") for code, body in results)
    assert len(set(wait_for_log(serve, streams).values())) == 2  # both had streams to drain
    assert left_in_redis(store) == []
    assert recorded(store) == Counter(rids + streams)


def test_a_second_signal_cuts_both_workers_short(serve: procs.Proc, store: RedisServer) -> None:
    """SIGTERM, then SIGTERM again once both drain: the parent forces its workers (its
    own signal for it), and the streams still running are told `shutting_down` at once,
    each recorded, nothing left held in Redis."""
    warm_up(serve, "forced-warm")
    streams = [f"workers-{RUN}-forced-{i}" for i in range(STREAMS)]
    started = threading.Barrier(STREAMS + 1)
    assert serve.popen is not None
    with ThreadPoolExecutor(STREAMS) as pool:
        answers = [pool.submit(stream, serve, rid, started) for rid in streams]
        started.wait(timeout=30)  # every stream has its first bytes: all in flight
        serve.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10  # another process's log has no event: polled
        while serve.log.read_text().count("stopping: draining requests") < 2:
            assert time.monotonic() < deadline, serve.log.read_text()[-2000:]
            time.sleep(0.02)
        serve.popen.send_signal(signal.SIGTERM)
        assert serve.popen.wait(timeout=30) == 0
        results = [a.result(timeout=30) for a in answers]
    for code, body in results:  # the streams last 2 s: cut long before their end
        assert code == 200 and b'"shutting_down"' in body and b"[DONE]" not in body, body
    assert left_in_redis(store) == []
    assert set(streams) <= recorded(store).keys()


def test_a_changed_config_reaches_every_worker(
    serve: procs.Proc, sim: procs.Proc, store: RedisServer, tmp_path: Path
) -> None:
    warm_up(serve, "reload-warm")
    config_file = tmp_path / f"gateway-{serve.port}.yaml"
    text = config_file.read_text()
    added = f'  added:\n    endpoints: [{{url: "{sim.url}", max_concurrency: 4, model: m1}}]\n'
    config_file.write_text(text.replace("keys:", added + "keys:"))
    assert serve.popen is not None
    serve.popen.send_signal(signal.SIGHUP)  # to the parent: it passes it on
    # Until both workers have served the new model (each applies it on its own).
    pids: set[int] = set()
    for i in range(WARM_UP_MAX):
        rid = f"workers-{RUN}-reload-{i}"
        body = {"model": "added", "prompt": "x", "max_tokens": 2}
        headers = {**AUTH, "x-request-id": rid}
        answer = httpx.post(serve.url + "/v1/completions", json=body, headers=headers, timeout=30)
        if answer.status_code == 200:
            pids.add(wait_for_log(serve, [rid])[rid])
        if len(pids) == 2:
            break
    assert len(pids) == 2, "a worker never served the model the new config added"


def test_what_a_killed_worker_spooled_reaches_redis_once(
    serve: procs.Proc, store: RedisServer, tmp_path: Path
) -> None:
    warm = set(warm_up(serve, "spool-warm"))
    store.kill()  # records now wait in the spool of the worker that served them
    outage = warm_up(serve, "spool-outage")
    by_pid = wait_for_log(serve, outage)
    victim = by_pid[outage[-1]]
    spool_dir = tmp_path / "spool"

    def victims_spool() -> list[Path]:
        return [p for p in spool_dir.glob(f"gateway-usage-*-{victim}-*.jsonl") if p.stat().st_size]

    deadline = time.monotonic() + 20
    while not victims_spool():
        assert time.monotonic() < deadline, "the worker never spooled its records"
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    store.start()  # empty: only what the spools send arrives
    deadline = time.monotonic() + 30

    def outage_records() -> Counter[str]:
        # A warm-up request's release may still have been under way when Redis went (its
        # answer comes first): its record was spooled too and may arrive here, once.
        found = recorded(store)
        assert all(n == 1 for n in found.values()), f"a record twice: {found}"
        return Counter({rid: n for rid, n in found.items() if rid not in warm})

    while outage_records() != Counter(outage):
        assert time.monotonic() < deadline, f"records: {recorded(store)}"
        time.sleep(0.1)
    # Adopted, then removed: once Redis took its records' batch (the removal follows the
    # reply, so it may come a moment after the records show).
    while list(spool_dir.glob(f"gateway-usage-*-{victim}-*")):
        assert time.monotonic() < deadline, "the adopted spool file was never removed"
        time.sleep(0.05)
    assert serve.stop(signal.SIGTERM) == 0
    assert outage_records() == Counter(outage)


def test_a_stuck_worker_is_killed_and_started_again(
    sim: procs.Proc, store: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stopped (SIGSTOP: its loop no longer turns) would keep its share of new
    connections waiting for ever: its parent kills it once its heartbeats have been missing
    for the hang limit, and starts another; requests are served by two live workers again."""
    monkeypatch.setenv("GATEWAY_WORKER_HANG_S", "2")
    text = config(sim, store.url, tmp_path / "spool")
    gateway = procs.gateway(
        tmp_path, text, "--workers", "2", "--access-log", "--log-format", "json", group=True
    )
    victim = 0
    try:
        rids = warm_up(gateway, "stuck-warm")
        victim = wait_for_log(gateway, rids)[rids[-1]]
        deadline = time.monotonic() + 20
        while recorded(store) != Counter(rids):  # its records are in before it stops
            assert time.monotonic() < deadline, f"records: {recorded(store)}"
            time.sleep(0.05)
        os.kill(victim, signal.SIGSTOP)
        deadline = time.monotonic() + 20
        while f"worker {victim} was killed by signal {int(signal.SIGKILL)}" not in (
            log := gateway.log.read_text()
        ):
            assert time.monotonic() < deadline, "the parent never killed its stuck worker"
            time.sleep(0.05)
        assert f"worker {victim} has not run its event loop" in log
        more = warm_up(gateway, "stuck-after")
        assert victim not in wait_for_log(gateway, more).values()
        assert gateway.stop() == 0
        assert recorded(store) == Counter(rids + more)
    finally:
        if victim:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)  # stopped and never killed: not left behind
        gateway.stop()
