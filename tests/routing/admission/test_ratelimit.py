"""Rate limits at the Redis level (routing/store/lua/ratelimit.lua, ratelimit_settle.lua,
routing/admission/ratelimit.py): GCRA conformance, refill, what a refusal says, the
give-back and the true-up, and the hash's expiry.

Time is Redis's own (TIME): a test that needs a bucket to have refilled ages it, moving
its stored arrival time back, rather than sleeping; limits are small enough that the
few milliseconds a test takes refill nothing that counts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from routing.admission.ratelimit import (
    NEVER,
    REFUSED_REQUESTS,
    REFUSED_TOKENS,
    TAKEN,
    RateCharge,
    RateLimits,
    Rates,
    quotas_of,
    rate_limits,
)
from routing.errors import Limited, LimitReason
from routing.quotas import Quota, Quotas
from routing.store.connect import RedisPyStore
from routing.store.keys import rate_key
from routing.store.scripts import Call, Scripts
from tests.redis_server import RedisServer

MINUTE_US = 60_000_000
KEY = rate_key("t-rl")


def limits(**given: int) -> RateLimits:
    made = rate_limits("t-rl", "k1", *(given.get(n) for n in ("rpm", "tpm", "arpm", "atpm")))
    assert made is not None
    return made


class Buckets:
    """The account t-rl's buckets and the two scripts, bound to one client."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.store = RedisPyStore(client, 2.0)
        self.scripts = Scripts()

    async def run(self, call: Call) -> Any:
        return await asyncio.wait_for(self.scripts.call(self.store, call), 5)

    async def take(self, rates: RateLimits, tokens: int = 0) -> list[int]:
        return [int(x) for x in await self.run(Rates.take(rates, tokens))]

    async def peek(self, rates: RateLimits) -> list[int]:
        call = ("ratelimit", [KEY], ["0", 0, *rates.buckets()])
        return [int(x) for x in await self.run(call)]

    async def settle(self, rates: RateLimits, requests: int, tokens: int) -> int:
        call = ("ratelimit_settle", [KEY], [requests, tokens, *rates.buckets()])
        return int(await self.run(call))

    async def age(self, field: str, seconds: float) -> None:
        """As if `seconds` had passed for this bucket."""
        await self.client.hincrbyfloat(KEY, field, -seconds * 1_000_000)

    async def ahead_us(self, field: str) -> float:
        """How far the bucket's arrival time is ahead of Redis's now."""
        script = (
            "local t = redis.call('TIME') "
            "local now = (tonumber(t[1]) - 1767225600) * 1000000 + tonumber(t[2]) "
            "return tostring(tonumber(redis.call('HGET', KEYS[1], ARGV[1])) - now)"
        )
        return float(await self.client.eval(script, 1, KEY, field))


@pytest.fixture
async def buckets(real_redis: aioredis.Redis) -> Buckets:
    return Buckets(real_redis)


# --- conformance -----------------------------------------------------------------------------


async def test_a_full_bucket_takes_its_limit_at_once_then_refuses(buckets: Buckets) -> None:
    rates = limits(rpm=3)  # one request each 20 s: the test never earns one
    remaining = [(await buckets.take(rates))[3] for _ in range(3)]
    assert remaining == [2, 1, 0]
    status, wait_ms, limit, left, reset_ms, *tokens = await buckets.take(rates)
    assert (status, limit, left, tokens) == (REFUSED_REQUESTS, 3, 0, [0, 0, 0])
    # The next conforms when the first request's 20 s have come back; full after 60 s.
    assert 19_000 < wait_ms <= 20_000
    assert 59_000 < reset_ms <= 60_000
    assert await buckets.ahead_us("r:k1") <= MINUTE_US  # the refusal charged nothing


async def test_a_bucket_refills_continuously(buckets: Buckets) -> None:
    rates = limits(rpm=6)  # one each 10 s
    for _ in range(6):
        assert (await buckets.take(rates))[0] == TAKEN
    assert (await buckets.take(rates))[0] == REFUSED_REQUESTS
    await buckets.age("r:k1", 25)  # two and a half emission intervals
    taken = [(await buckets.take(rates))[0] for _ in range(3)]
    assert taken == [TAKEN, TAKEN, REFUSED_REQUESTS]
    await buckets.age("r:k1", 3600)  # long idle: full, never more than full
    assert [(await buckets.take(rates))[3] for _ in range(6)] == [5, 4, 3, 2, 1, 0]


async def test_a_window_of_t_seconds_takes_the_burst_and_t_seconds_of_refill(
    buckets: Buckets,
) -> None:
    """docs/api.md's rule, as OpenAI states its own: a burst of N, then N a minute. In any
    t seconds at most N + N*t/60: rpm 60 takes 61 within 1.5 s, not "60 in any minute"."""
    rates = limits(rpm=60)
    assert [(await buckets.take(rates))[0] for _ in range(60)] == [TAKEN] * 60
    await buckets.age("r:k1", 1.5)
    assert [(await buckets.take(rates))[0] for _ in range(2)] == [TAKEN, REFUSED_REQUESTS]


async def test_tokens_are_charged_by_the_request_and_refused_with_their_wait(
    buckets: Buckets,
) -> None:
    rates = limits(tpm=1000)
    assert [(await buckets.take(rates, 300))[6] for _ in range(3)] == [700, 400, 100]
    status, wait_ms, *counts = await buckets.take(rates, 300)
    # 200 tokens short: 200 / 1000 of a minute until it would conform.
    assert (status, counts[:3], counts[3:5]) == (REFUSED_TOKENS, [0, 0, 0], [1000, 100])
    assert 11_000 < wait_ms <= 12_000
    assert (await buckets.take(rates, 100))[0] == TAKEN  # what is left still serves
    assert (await buckets.take(rates, 0))[0] == TAKEN  # a request of no tokens always does


async def test_more_tokens_than_a_whole_bucket_can_never_conform(buckets: Buckets) -> None:
    rates = limits(rpm=10, atpm=1000)
    status, wait_ms, *_ = await buckets.take(rates, 1001)
    assert (status, wait_ms) == (NEVER, 60_000)
    assert not await buckets.client.exists(KEY)  # nothing taken, not even the request
    assert (await buckets.take(rates, 1000))[0] == TAKEN  # exactly a bucket's worth fits


async def test_every_bucket_must_conform_or_none_is_charged(buckets: Buckets) -> None:
    """The key's and the account's, of both kinds: one refusal charges none of them."""
    k1 = limits(rpm=100, tpm=10_000, arpm=2, atpm=10_000)
    k2 = RateLimits("t-rl", "k2", 100, 10_000, 2, 10_000)
    assert (await buckets.take(k1, 10))[0] == TAKEN
    assert (await buckets.take(k2, 10))[0] == TAKEN
    before = await buckets.client.hgetall(KEY)
    assert (await buckets.take(k1, 10))[0] == REFUSED_REQUESTS  # the account's 2 are spent
    assert await buckets.client.hgetall(KEY) == before
    assert set(before) == {b"r", b"t", b"r:k1", b"t:k1", b"r:k2", b"t:k2"}


async def test_the_answer_reports_the_bucket_with_fewest_remaining(buckets: Buckets) -> None:
    rates = limits(rpm=5, arpm=100, tpm=10_000, atpm=1000)
    _, _, rpm, r_left, _, tpm, t_left, _ = await buckets.take(rates, 100)
    assert (rpm, r_left) == (5, 4)  # the key's requests, the account's tokens
    assert (tpm, t_left) == (1000, 900)


async def test_a_read_charges_nothing(buckets: Buckets) -> None:
    rates = limits(rpm=5, tpm=1000)
    assert await buckets.peek(rates) == [TAKEN, 0, 5, 5, 0, 1000, 1000, 0]
    assert not await buckets.client.exists(KEY)
    await buckets.take(rates, 400)
    status, _, _, r_left, r_reset, _, t_left, t_reset = await buckets.peek(rates)
    assert (status, r_left, t_left) == (TAKEN, 4, 600)
    assert 11_000 < r_reset <= 12_000 and 23_000 < t_reset <= 24_000


# --- give-back and true-up -------------------------------------------------------------------


async def test_a_give_back_restores_what_the_take_charged(buckets: Buckets) -> None:
    rates = limits(rpm=2, tpm=1000)
    await buckets.take(rates, 500)
    await buckets.take(rates, 500)
    assert (await buckets.take(rates, 1))[0] == REFUSED_REQUESTS
    assert await buckets.settle(rates, -1, -500) == 1
    assert (await buckets.peek(rates))[2:4] == [2, 1]
    assert (await buckets.take(rates, 500))[0] == TAKEN


async def test_a_give_back_never_makes_a_bucket_fuller_than_full(buckets: Buckets) -> None:
    rates = limits(rpm=2)
    await buckets.take(rates)
    await buckets.settle(rates, -1, 0)
    await buckets.settle(rates, -1, 0)  # twice: the second finds it full
    assert [(await buckets.take(rates))[0] for _ in range(3)] == [TAKEN, TAKEN, REFUSED_REQUESTS]
    await buckets.client.delete(KEY)
    assert await buckets.settle(rates, -1, 0) == 0  # a bucket gone is full: nothing to do
    assert not await buckets.client.exists(KEY)


async def test_a_true_up_charges_the_tokens_used_at_most_a_minute_ahead(buckets: Buckets) -> None:
    rates = limits(tpm=1000)
    await buckets.take(rates, 100)
    await buckets.settle(rates, 0, 150)  # used 250
    assert (await buckets.peek(rates))[6] == 750
    await buckets.settle(rates, 0, -200)  # used 50
    assert (await buckets.peek(rates))[6] == 950
    await buckets.settle(rates, 0, 5000)  # far more than reserved: a minute in debt at most
    assert 59_000_000 < await buckets.ahead_us("t:k1") <= MINUTE_US
    status, wait_ms, *_ = await buckets.take(rates, 1000)
    assert status == REFUSED_TOKENS and wait_ms <= 60_000


async def test_a_true_up_on_a_bucket_gone_makes_it_again_with_its_expiry(
    buckets: Buckets,
) -> None:
    rates = limits(tpm=1000)
    assert await buckets.settle(rates, 0, 500) == 1
    assert (await buckets.peek(rates))[6] == 500
    assert 0 < await buckets.client.pttl(KEY) <= 120_000


async def test_the_hash_expires_after_two_idle_minutes_and_outlives_its_debt(
    buckets: Buckets,
) -> None:
    """Every write sets it again: past its expiry every bucket in it is full anyway."""
    rates = limits(rpm=1, tpm=100)
    await buckets.take(rates, 100)
    ttl_ms = await buckets.client.pttl(KEY)
    assert 60_000 < ttl_ms <= 120_000
    assert max([await buckets.ahead_us("r:k1"), await buckets.ahead_us("t:k1")]) <= MINUTE_US
    await buckets.client.pexpire(KEY, 10)
    await buckets.take(rates, 0)  # refused: writes nothing, nor sets the expiry again
    assert await buckets.client.pttl(KEY) <= 10


async def test_a_take_and_a_settle_run_while_redis_is_full(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, maxmemory="2mb").start()
    client = aioredis.Redis.from_url(server.url)
    try:
        full = Buckets(client)
        await client.eval(
            "for i = 1, 300 do redis.call('SET', 'filler:' .. i, string.rep('x', 10000)) end", 0
        )
        with pytest.raises(ResponseError, match="maxmemory"):
            await client.set("probe", "x")
        rates = limits(rpm=5, tpm=1000)
        assert (await full.take(rates, 100))[0] == TAKEN
        assert await full.settle(rates, 0, -50) == 1
        assert (await full.peek(rates))[6] == 950
    finally:
        await client.aclose()
        server.stop()


# --- the values of routing/admission/ratelimit.py --------------------------------------------


def test_a_key_without_limits_has_none() -> None:
    assert rate_limits("a", "k", None, None, None, None) is None
    assert limits(arpm=5).buckets() == ["r", 5]
    assert limits(rpm=1, tpm=2, arpm=3, atpm=4).buckets("t") == ["t:k1", 2, "t", 4]
    assert limits(rpm=7, arpm=5, tpm=9).unknown() == Quotas(Quota(5), Quota(9))


@pytest.mark.parametrize(
    ("status", "wait_ms", "reason", "retry"),
    [
        (REFUSED_REQUESTS, 1, LimitReason.RATE_LIMIT_REQUESTS, 1),
        (REFUSED_REQUESTS, 1001, LimitReason.RATE_LIMIT_REQUESTS, 2),
        (REFUSED_TOKENS, 60_000, LimitReason.RATE_LIMIT_TOKENS, 60),
    ],
)
def test_a_refusal_is_a_429_that_says_when_it_would_conform(
    status: int, wait_ms: int, reason: LimitReason, retry: int
) -> None:
    reply = [status, wait_ms, 30, 0, 1500, 1000, 10, 60_000]
    with pytest.raises(Limited) as caught:
        Rates.taken(limits(rpm=30, tpm=1000), 500, reply)
    assert (caught.value.reason, caught.value.retry_after_s) == (reason, retry)
    assert caught.value.retryable
    assert caught.value.quotas == quotas_of(reply)


def test_a_charge_larger_than_the_bucket_says_it_can_never_fit() -> None:
    with pytest.raises(Limited) as caught:
        Rates.taken(limits(tpm=5000, atpm=1000), 1200, [NEVER, 60_000, 0, 0, 0, 1000, 1000, 0])
    error = caught.value
    assert (error.reason, error.retryable) == (LimitReason.RATE_LIMIT_TOKENS, False)
    assert "1200 tokens" in error.message and "limit of 1000" in error.message


def test_a_charge_given_back_reports_the_bucket_as_it_was() -> None:
    quotas = Quotas(Quota(30, 4, 54_000), Quota(1000, 0, 60_000))
    charge = RateCharge(limits(rpm=30, tpm=1000), 100, quotas)
    assert charge.refunded() == Quotas(Quota(30, 5, 52_000), Quota(1000, 100, 54_000))
