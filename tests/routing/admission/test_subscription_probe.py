"""The wake-ups' subscription asks Redis for a word every second and breaks when none comes
(routing/admission/wakeups.py `Probe`): a connection that stops without a word (a stalled
Redis, a dropped network) would otherwise lose every wake-up until a sweep named the
waiters. Against a redis-server of the test's own, stopped with SIGSTOP."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from routing.admission.wakeups import (
    PROBE_EVERY_S,
    PROBE_LIMIT_S,
    Probe,
    SubscriptionSilent,
    Wakeups,
)
from tests.redis_server import RedisServer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_ping_goes_every_interval_and_one_unanswered_is_late() -> None:
    clock = Clock()
    probe = Probe(clock)
    assert not probe.due()
    clock.now = PROBE_EVERY_S
    assert probe.due()  # sent
    clock.now += PROBE_LIMIT_S
    assert not probe.due() and not probe.late()  # waiting for its answer, not yet late
    probe.heard()  # a message or the pong: the connection delivers
    clock.now += PROBE_EVERY_S
    assert probe.due()
    clock.now += PROBE_LIMIT_S + 0.1
    assert probe.late() and not probe.due()


class Woken:
    """Stands for the waiters: nothing is woken in this test."""

    holdings: Any = None


@pytest.mark.slow
async def test_a_stalled_redis_breaks_the_subscription_within_the_probes_limit(
    private_redis: RedisServer,
) -> None:
    client = aioredis.Redis.from_url(private_redis.url, socket_timeout=None)
    wakeups = Wakeups(Woken(), None)  # type: ignore[arg-type]
    try:
        listening = asyncio.create_task(wakeups.listen(client, ["gw:v2:{m}:wake"]))
        for _ in range(200):  # subscribed: at most 2 s
            if wakeups.listening:
                break
            await asyncio.sleep(0.01)
        assert wakeups.listening
        await asyncio.sleep(PROBE_EVERY_S * 1.5)
        assert not listening.done()  # pings answered: it goes on
        private_redis.pause()
        with pytest.raises(SubscriptionSilent):
            await asyncio.wait_for(listening, PROBE_EVERY_S + PROBE_LIMIT_S + 3.0)
        assert not wakeups.listening
    finally:
        private_redis.resume()
        await client.aclose()
