"""API keys: header order, config and Redis digests, the lookup cache, Redis failures."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import orjson
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.errors import AuthenticationFailed, ServiceUnavailable
from gateway.runtime.auth import KEY_PREFIX, KeyStore, create_key, key_from_headers
from gateway.runtime.settings import AccountConfig, KeyConfig, digest_key
from routing.admission.ratelimit import RateLimits
from routing.store.keys import API_KEYS_HASH as KEYS_HASH
from tiers.policy import Tier


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingRedis:
    """Delegates to a fake Redis, counting `hget` calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.hgets = 0

    async def hget(self, name: str, key: str) -> Any:
        self.hgets += 1
        return await self.inner.hget(name, key)


class BrokenRedis:
    async def hget(self, name: str, key: str) -> Any:
        raise RedisConnectionError("connection refused")


@pytest.fixture
async def redis() -> AsyncIterator[Any]:
    client = fakeredis.FakeAsyncRedis()
    try:
        yield client
    finally:
        await client.aclose()


def key_config(key: str, **fields: Any) -> KeyConfig:
    return KeyConfig(sha256=digest_key(key), **{"account": "acme", **fields})


def store(redis: Any, *keys: KeyConfig, **options: Any) -> KeyStore:
    return KeyStore(keys, redis, **options)


# --- key_from_headers -----------------------------------------------------------------------


def test_bearer_wins_over_other_headers() -> None:
    assert key_from_headers("Bearer k1", "k2", "k3") == "k1"


def test_x_api_key_wins_over_xi_api_key() -> None:
    assert key_from_headers(None, "k2", "k3") == "k2"


def test_xi_api_key_last() -> None:
    assert key_from_headers(None, None, "k3") == "k3"


def test_bearer_scheme_case_insensitive_and_value_trimmed() -> None:
    assert key_from_headers("bearer   k1  ", None, None) == "k1"
    assert key_from_headers("BEARER k1", None, None) == "k1"


@pytest.mark.parametrize("authorization", ["Basic dXNlcjpwYXNz", "Token k1", "k1", "Bearer"])
def test_non_bearer_authorization_is_skipped(authorization: str) -> None:
    assert key_from_headers(authorization, "k2", None) == "k2"
    assert key_from_headers(authorization, None, None) is None


@pytest.mark.parametrize("blank", ["", "   ", "Bearer ", "Bearer    "])
def test_blank_values_are_skipped(blank: str) -> None:
    assert key_from_headers(blank, blank.replace("Bearer", ""), "k3") == "k3"


def test_no_key_at_all() -> None:
    assert key_from_headers(None, None, None) is None
    assert key_from_headers("", " ", "\t") is None


def test_header_values_trimmed() -> None:
    assert key_from_headers(None, "  k2 ", None) == "k2"
    assert key_from_headers(None, None, " k3\t") == "k3"


# --- KeyStore with config keys ----------------------------------------------------------------


async def test_configured_key_authenticates(redis: Any) -> None:
    cfg = key_config(
        "sk-one", max_concurrency=7, models=("m1", "m2"), tiers=(Tier.DEFAULT, Tier.FLEX)
    )
    account = await store(redis, cfg).authenticate("sk-one")
    assert account.name == "acme"
    assert account.digest == digest_key("sk-one")
    assert account.key_id == digest_key("sk-one")[:12]
    assert account.max_concurrency == 7
    assert account.models == frozenset({"m1", "m2"})
    assert account.tiers == frozenset({Tier.DEFAULT, Tier.FLEX})


async def test_configured_key_without_lists_allows_everything(redis: Any) -> None:
    account = await store(redis, key_config("sk-one")).authenticate("sk-one")
    assert account.models is None
    assert account.tiers is None
    assert account.max_concurrency == 200


async def test_configured_uppercase_digest_matches(redis: Any) -> None:
    cfg = KeyConfig(sha256=digest_key("sk-up").upper(), account="acme")
    assert (await store(redis, cfg).authenticate("sk-up")).name == "acme"


async def test_configured_key_needs_no_redis() -> None:
    account = await store(BrokenRedis(), key_config("sk-one")).authenticate("sk-one")
    assert account.name == "acme"


@pytest.mark.parametrize("key", [None, "", "sk-other", "SK-ONE", "sk-one "])
async def test_unknown_or_missing_key_fails(redis: Any, key: str | None) -> None:
    with pytest.raises(AuthenticationFailed) as info:
        await store(redis, key_config("sk-one")).authenticate(key)
    assert info.value.status == 401
    assert info.value.headers == {"www-authenticate": "Bearer"}


async def test_over_long_key_fails_without_lookup(redis: Any) -> None:
    counting = CountingRedis(redis)
    with pytest.raises(AuthenticationFailed):
        await store(counting).authenticate("k" * 513)
    assert counting.hgets == 0


async def test_over_long_key_fails_even_if_configured(redis: Any) -> None:
    long_key = "k" * 513
    with pytest.raises(AuthenticationFailed):
        await store(redis, key_config(long_key)).authenticate(long_key)


async def test_key_of_exactly_512_is_looked_up(redis: Any) -> None:
    key = "k" * 512
    assert (await store(redis, key_config(key)).authenticate(key)).name == "acme"


# --- KeyStore with Redis ------------------------------------------------------------------


async def test_created_key_is_stored_only_as_digest(redis: Any) -> None:
    key = await create_key(redis, "acme", max_concurrency=5)
    assert key.startswith(KEY_PREFIX)
    stored = await redis.hgetall(KEYS_HASH)
    assert list(stored) == [digest_key(key).encode()]
    for field, value in stored.items():
        assert key.encode() not in field
        assert key.encode() not in value
        assert key[len(KEY_PREFIX) :].encode() not in value


async def test_created_keys_differ(redis: Any) -> None:
    assert await create_key(redis, "a") != await create_key(redis, "a")


async def test_created_key_authenticates(redis: Any) -> None:
    key = await create_key(redis, "acme", max_concurrency=5)
    account = await store(redis).authenticate(key)
    assert account.name == "acme"
    assert account.max_concurrency == 5
    assert account.key_id == digest_key(key)[:12]
    assert account.models is None
    assert account.tiers is None


async def test_allow_lists_round_trip_through_redis(redis: Any) -> None:
    key = await create_key(
        redis, "acme", models=["org/a", "org/b"], tiers=[Tier.PRIORITY, Tier.DEFAULT]
    )
    record = orjson.loads(await redis.hget(KEYS_HASH, digest_key(key)))
    assert record["tiers"] == ["priority", "default"]
    account = await store(redis).authenticate(key)
    assert account.models == frozenset({"org/a", "org/b"})
    assert account.tiers == frozenset({Tier.PRIORITY, Tier.DEFAULT})


async def test_empty_allow_lists_stay_empty_not_unrestricted(redis: Any) -> None:
    key = await create_key(redis, "acme", models=[], tiers=[])
    account = await store(redis).authenticate(key)
    assert account.models == frozenset()
    assert account.tiers == frozenset()


async def test_unknown_key_with_redis_fails(redis: Any) -> None:
    await create_key(redis, "acme")
    with pytest.raises(AuthenticationFailed):
        await store(redis).authenticate("gw-not-a-real-key")


async def test_found_key_is_cached_until_ttl(redis: Any) -> None:
    clock = Clock()
    counting = CountingRedis(redis)
    key = await create_key(redis, "acme")
    keys = store(counting, ttl_s=10.0, clock=clock)
    await keys.authenticate(key)
    clock.now += 9.9
    await keys.authenticate(key)
    assert counting.hgets == 1
    clock.now += 0.2
    await keys.authenticate(key)
    assert counting.hgets == 2


async def test_negative_cache_skips_redis_until_it_expires(redis: Any) -> None:
    clock = Clock()
    counting = CountingRedis(redis)
    keys = store(counting, negative_ttl_s=2.0, clock=clock)
    for _ in range(3):
        with pytest.raises(AuthenticationFailed):
            await keys.authenticate("gw-unknown")
    assert counting.hgets == 1
    clock.now += 2.5
    with pytest.raises(AuthenticationFailed):
        await keys.authenticate("gw-unknown")
    assert counting.hgets == 2


async def test_key_created_after_a_miss_works_once_negative_entry_expires(redis: Any) -> None:
    clock = Clock()
    keys = store(redis, negative_ttl_s=2.0, clock=clock)
    key = KEY_PREFIX + "late"
    with pytest.raises(AuthenticationFailed):
        await keys.authenticate(key)
    await redis.hset(KEYS_HASH, digest_key(key), orjson.dumps({"account": "late"}))
    with pytest.raises(AuthenticationFailed):
        await keys.authenticate(key)  # still negatively cached
    clock.now += 3.0
    assert (await keys.authenticate(key)).name == "late"


async def test_cache_is_bounded(redis: Any) -> None:
    counting = CountingRedis(redis)
    keys = store(counting, max_cached=2, clock=Clock())
    for key in ("a", "b", "c"):
        with pytest.raises(AuthenticationFailed):
            await keys.authenticate(key)
    assert counting.hgets == 3
    with pytest.raises(AuthenticationFailed):
        await keys.authenticate("c")  # still cached
    assert counting.hgets == 3
    with pytest.raises(AuthenticationFailed):
        await keys.authenticate("a")  # evicted first
    assert counting.hgets == 4


async def test_redis_error_is_service_unavailable() -> None:
    with pytest.raises(ServiceUnavailable) as info:
        await store(BrokenRedis()).authenticate("gw-anything")
    assert info.value.status == 503
    assert isinstance(info.value.__cause__, RedisConnectionError)


async def test_redis_error_is_not_cached() -> None:
    broken = BrokenRedis()
    keys = store(broken, clock=Clock())
    for _ in range(2):
        with pytest.raises(ServiceUnavailable):
            await keys.authenticate("gw-anything")


async def test_weight_round_trips_through_redis(redis: Any) -> None:
    key = await create_key(redis, "acme", weight=3.0)
    assert (await store(redis).authenticate(key)).weight == 3.0
    plain = await create_key(redis, "other")
    assert (await store(redis).authenticate(plain)).weight == 1.0


# --- rate limits ----------------------------------------------------------------------------


async def test_rate_limits_round_trip_through_redis_with_the_accounts_own(redis: Any) -> None:
    key = await create_key(redis, "acme", rpm=30, tpm=50_000)
    accounts = {"acme": AccountConfig(rpm=600), "other": AccountConfig(tpm=10)}
    account = await store(redis, accounts=accounts).authenticate(key)
    assert (account.rpm, account.tpm, account.account_rpm, account.account_tpm) == (
        30, 50_000, 600, None,
    )  # fmt: skip
    assert account.rates == RateLimits("acme", account.key_id, 30, 50_000, 600, None)
    plain = await store(redis).authenticate(await create_key(redis, "acme"))
    assert (plain.rpm, plain.tpm, plain.rates) == (None, None, None)


async def test_a_configured_key_meets_its_accounts_limits(redis: Any) -> None:
    keys = store(
        redis,
        key_config("k-own", tpm=100),
        key_config("k-acct"),
        key_config("k-none", account="free"),
        accounts={"acme": AccountConfig(rpm=5)},
    )
    own = (await keys.authenticate("k-own")).rates
    assert own is not None and (own.tpm, own.account_rpm) == (100, 5)
    whole = (await keys.authenticate("k-acct")).rates
    assert whole is not None and (whole.rpm, whole.account_rpm) == (None, 5)
    assert (await keys.authenticate("k-none")).rates is None


@pytest.mark.parametrize("written", [0, -3, "30", 2.5, True, 10**13, None])
async def test_a_stored_limit_written_by_hand_out_of_range_is_none(
    redis: Any, written: object
) -> None:
    record = {"account": "acme", "rpm": written, "tpm": written}
    await redis.hset(KEYS_HASH, digest_key("gw-hand"), orjson.dumps(record))
    account = await store(redis).authenticate("gw-hand")
    assert (account.rpm, account.tpm, account.rates) == (None, None, None)
