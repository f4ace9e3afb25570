"""Live config: a changed file takes effect without a restart or a failed request in flight;
a broken file leaves the running config in force."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import redis

from routing.store.keys import account_key
from tests.conftest import REDIS_URL
from tests.e2e import procs
from tests.e2e.conftest import digest
from tests.redis_server import StreamEntries, endpoint_load
from tiers.usage import UsageRecord

KEY = "sk-reload"
AUTH = {"Authorization": f"Bearer {KEY}"}


def config(worker: procs.Proc, *, capacity: int, extra_model: bool) -> str:
    def model(name: str, size: int) -> str:
        return f'  {name}: {{endpoints: [{{url: "{worker.url}", max_concurrency: {size}}}]}}\n'

    text = f'redis: {{url: "{REDIS_URL}", lease_ttl_s: 5}}\nmodels:\n' + model("live", capacity)
    if extra_model:
        text += model("added", 2)
    return text + f'keys: [{{sha256: "{digest(KEY)}", account: reload}}]\n'


def wait_for(check: Any, what: str, limit_s: float = 10.0) -> None:
    """Another process's state has no event to wait on: poll it, bounded in time."""
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def models(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(url + "/v1/models", headers=AUTH).json()["data"]}


def fail_fast(url: str, model: str) -> int:
    body = {"model": model, "prompt": "x", "max_tokens": 1, "fail_fast": True}
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=10).status_code


def test_a_changed_config_applies_live_and_a_broken_one_is_refused(tmp_path: Path) -> None:
    timing = ("--ttft-ms", "0", "--itl-ms", "40", "--tokens", "60")
    worker = procs.sim(tmp_path, *timing, models=("live", "added"))
    gateway = procs.gateway(tmp_path, config(worker, capacity=1, extra_model=False))
    path = tmp_path / f"gateway-{gateway.port}.yaml"
    url = gateway.url
    try:
        assert models(url) == {"live"}
        body = {"model": "live", "prompt": "x", "stream": True}
        with httpx.stream(
            "POST", url + "/v1/completions", json=body, headers=AUTH, timeout=30
        ) as held:
            lines = held.iter_lines()
            assert next(lines).startswith("data: ")
            assert fail_fast(url, "live") == 429  # its one slot is taken
            path.write_text(config(worker, capacity=2, extra_model=True))
            wait_for(lambda: models(url) == {"live", "added"}, "the new model")
            assert fail_fast(url, "live") == 200  # the capacity grew under the held stream
            assert fail_fast(url, "added") == 200
            rest = [line for line in lines if line]
        assert "data: [DONE]" in rest  # the request in flight went through the reload

        path.write_text("models: {live: {endpoints: [{url: 'nope', max_concurrency: -1}]}}\n")
        assert gateway.popen is not None
        gateway.popen.send_signal(signal.SIGHUP)
        log = tmp_path / f"gateway-{gateway.port}.log"
        wait_for(lambda: "config reload refused" in log.read_text(), "the refusal in the log")
        assert models(url) == {"live", "added"}
        assert fail_fast(url, "added") == 200

        path.write_text(config(worker, capacity=1, extra_model=False))
        gateway.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: models(url) == {"live"}, "the removed model to go")
        assert httpx.post(url + "/v1/completions", headers=AUTH,
                          json={"model": "added", "prompt": "x"}).status_code == 404  # fmt: skip
    finally:
        gateway.stop()
        worker.stop()


# --- endpoints that leave or change under running requests -----------------------------------

RUN = uuid.uuid4().hex[:8]
TOKENS = 30


def fleet_config(drop: list[procs.Proc], change: procs.Proc, *, after: bool) -> str:
    """Model `drop` on two workers (the reload keeps only the second); model `change` on one
    worker whose size and served name the reload changes."""
    kept = drop[1:] if after else drop
    drop_eps = ", ".join(f'{{url: "{w.url}", max_concurrency: 2, model: m1}}' for w in kept)
    size, served = (3, "m2") if after else (2, "m1")
    return (
        f'redis: {{url: "{REDIS_URL}", lease_ttl_s: 5}}\n'
        "models:\n"
        f"  drop: {{endpoints: [{drop_eps}]}}\n"
        f'  change: {{endpoints: [{{url: "{change.url}", max_concurrency: {size}, '
        f"model: {served}}}]}}\n"
        f'keys: [{{sha256: "{digest(KEY)}", account: reload}}]\n'
    )


def metric(url: str, sample: str) -> float | None:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def sent_to(worker: procs.Proc) -> dict[str, dict[str, Any]]:
    """The bodies a worker received, by x-request-id."""
    requests = httpx.get(worker.url + "/sim/requests", timeout=5).json()["requests"]
    return {r["headers"].get("x-request-id", ""): r["body"] for r in requests}


def records(rids: set[str]) -> dict[str, list[UsageRecord]]:
    """The usage records of these requests in the run's Redis (stream `usage`)."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        found: dict[str, list[UsageRecord]] = {rid: [] for rid in rids}
        for _, raw in cast(StreamEntries, client.xrange("usage")):
            fields = {k.decode(): v.decode() for k, v in raw.items()}
            if fields.get("request_id") in found:
                found[fields["request_id"]].append(UsageRecord.from_fields(fields))
        return found
    finally:
        client.close()


def leases_left(model: str) -> tuple[int, int, int, int]:
    """What Redis still counts for `model`: leases, lease -> endpoint entries, load summed
    over its endpoints, and the account's entries."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        tag = "gw:v2:{" + model + "}:"
        load = endpoint_load(client.hgetall(tag + "ep_load"))
        account = client.zcard(account_key("reload"))
        return client.zcard(tag + "leases"), client.hlen(tag + "ep_of"), load, account
    finally:
        client.close()


def stream_lines(url: str, rid: str, model: str) -> Iterator[str]:
    body = {"model": model, "prompt": "x", "stream": True, "prompt_cache_key": "pin"}
    headers = {**AUTH, "x-request-id": rid}
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        yield from response.iter_lines()


def test_endpoints_that_leave_or_change_let_running_requests_finish(tmp_path: Path) -> None:
    timing = ("--ttft-ms", "0", "--itl-ms", "200", "--tokens", str(TOKENS))
    drop = [procs.sim(tmp_path, *timing) for _ in range(2)]
    change = procs.sim(tmp_path, *timing, models=("m1", "m2"))
    gateway = procs.gateway(tmp_path, fleet_config(drop, change, after=False))
    path = tmp_path / f"gateway-{gateway.port}.yaml"
    url = gateway.url
    rid = {name: f"reload-{RUN}-{name}" for name in ("stream", "plain", "changed", "after")}
    try:
        # A stream and a plain request (whose answer arrives whole, at its end) on the same
        # endpoint of `drop`, and a stream on `change`'s endpoint, all running.
        stream = stream_lines(url, rid["stream"], "drop")
        assert next(stream).startswith("data: ")
        gone = next(w for w in drop if rid["stream"] in sent_to(w))
        kept = next(w for w in drop if w is not gone)
        plain: dict[str, httpx.Response] = {}
        body = {"model": "drop", "prompt": "x", "prompt_cache_key": "pin"}
        thread = threading.Thread(target=lambda: plain.setdefault("r", httpx.post(
            url + "/v1/completions", json=body, timeout=60,
            headers={**AUTH, "x-request-id": rid["plain"]})))  # fmt: skip
        thread.start()
        wait_for(lambda: rid["plain"] in sent_to(gone), "the plain request on the same worker")
        changed = stream_lines(url, rid["changed"], "change")
        assert next(changed).startswith("data: ")

        if kept is drop[0]:
            drop.reverse()  # the reload keeps drop[1:]
        path.write_text(fleet_config(drop, change, after=True))
        assert gateway.popen is not None
        gateway.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: metric(url, 'gateway_capacity{model="change"}') == 3.0, "the reload")
        assert metric(url, 'gateway_capacity{model="drop"}') == 2.0
        running = {rid["stream"], rid["plain"], rid["changed"]}
        assert all(v == [] for v in records(running).values())  # none has ended yet

        # New requests go to the endpoint that stays, and under the new served name.
        for i in range(3):
            headers = {**AUTH, "x-request-id": f"{rid['after']}-{i}"}
            for model in ("drop", "change"):
                r = httpx.post(url + "/v1/completions", headers=headers, timeout=30,
                               json={"model": model, "prompt": "x", "max_tokens": 1})  # fmt: skip
                assert r.status_code == 200, r.text
        assert all(f"{rid['after']}-{i}" in sent_to(kept) for i in range(3))
        assert not any(r.startswith(rid["after"]) for r in sent_to(gone))
        assert sent_to(change)[f"{rid['after']}-0"]["model"] == "m2"

        # The requests that were running finish as if nothing happened.
        for lines in (stream, changed):
            rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]" and not any('"error"' in x for x in rest)
        thread.join(timeout=60)
        assert plain["r"].status_code == 200, plain["r"].text
        assert plain["r"].json()["usage"]["completion_tokens"] == TOKENS

        wait_for(lambda: all(len(v) == 1 for v in records(running).values()), "the records")
        for request_id, (record,) in records(running).items():
            assert (record.status, record.outcome) == (200, "complete"), request_id
            assert (record.completion_tokens, record.estimated) == (TOKENS, False), request_id
        wait_for(lambda: leases_left("drop") == leases_left("change") == (0, 0, 0, 0),
                 "every lease released")  # fmt: skip
    finally:
        gateway.stop()
        for worker in (*drop, change):
            worker.stop()
