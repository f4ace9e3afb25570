"""The usage records of given requests, read from the stream `usage` of the tests' own Redis
(the gateway writes them after the answer: waited for, bounded)."""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import cast

import redis

from tests.redis_server import TextStreamEntries


def records(redis_url: str, rids: Collection[str]) -> dict[str, list[dict[str, str]]]:
    found: dict[str, list[dict[str, str]]] = {rid: [] for rid in rids}
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        entries = cast(TextStreamEntries, client.xrange("usage"))
    finally:
        client.close()
    for _, fields in entries:
        rid = fields.get("request_id")
        if rid in found:
            found[rid].append(fields)
    return found


def wait_records(
    redis_url: str, rids: Collection[str], limit_s: float = 10.0
) -> dict[str, list[dict[str, str]]]:
    """Each request's records once every one has at least one (a cancelled stream's comes
    after its caller left), or what there is at the deadline."""
    deadline = time.monotonic() + limit_s
    while True:
        found = records(redis_url, rids)
        if all(found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)
