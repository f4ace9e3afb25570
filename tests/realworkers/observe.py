"""What the tests read besides the answers: Prometheus text (the workers' and the
gateway's /metrics), the gateway's usage records and leases in the tests' own Redis, and a
bounded poll for a condition (there is no event to wait on across processes)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import TypeVar, cast

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.redis_server import TextStreamEntries, endpoint_load

T = TypeVar("T")


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples named `name` (a counter's `_total` included) with their labels."""
    found = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found.append((dict(sample.labels), float(sample.value)))
    return found


def value(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples of `name` whose labels include `labels`; None: no sample."""
    picked = [v for got, v in samples(text, name) if labels.items() <= got.items()]
    return sum(picked) if picked else None


def poll(what: str, probe: Callable[[], T | None], limit_s: float = 20.0) -> T:
    """`probe()` again until it gives something other than None or False, bounded."""
    deadline = time.monotonic() + limit_s
    while True:
        got = probe()
        if got is not None and got is not False:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {limit_s} s")
        time.sleep(0.05)


def gateway_budget(gateway_url: str, model: str, endpoint: str) -> float | None:
    """The gateway's `gateway_token_budget` of the endpoint (NaN: not read yet)."""
    text = httpx.get(gateway_url + "/metrics", timeout=10.0).text
    return value(text, "gateway_token_budget", model=model, endpoint=endpoint)


def gateway_gauge(gateway_url: str, name: str, **labels: str) -> float | None:
    text = httpx.get(gateway_url + "/metrics", timeout=10.0).text
    return value(text, name, **labels)


def known(number: float | None) -> float | None:
    """`number` unless it is absent or NaN (a poll's 'not yet')."""
    return None if number is None or math.isnan(number) else number


def usage_record(redis_url: str, rid: str) -> dict[str, str] | None:
    """The usage record of request `rid` in the stream `usage`; None while there is none
    (the gateway writes it after the answer)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        entries = cast(TextStreamEntries, client.xrevrange("usage", count=500))
    finally:
        client.close()
    for _, fields in entries:
        if fields.get("request_id") == rid:
            return dict(fields)
    return None


def held(redis_url: str, model: str) -> int:
    """Leases the model's requests hold in Redis, and the endpoints' counts of them."""
    tag = "gw:v2:{" + model + "}:"
    client = redis.Redis.from_url(redis_url)
    try:
        loads = cast(Mapping[bytes, bytes], client.hgetall(tag + "ep_load"))
        return int(client.zcard(tag + "leases")) + endpoint_load(loads)
    finally:
        client.close()
