"""redis+sentinel:// URLs (routing/store/sentinel.py): their parsing, and the lean client on a
master found by a locator, against real redis-servers this test starts (a replica made by
REPLICAOF, two masters to move between). The sentinels themselves, and a real failover,
are in tests/e2e/test_sentinel.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from gateway.runtime.settings import ConfigError, parse_config
from routing.store.causes import cause_of
from routing.store.resp import Demoted, NotSent, RespClient
from routing.store.sentinel import (
    FollowingPool,
    NoSentinel,
    Sentinels,
    SentinelURL,
    UnknownMaster,
    _Sentinel,
    parse,
)
from tests.redis_server import RedisServer, free_port
from tests.routing.servers import Locator

SECRET = "p@ss/w:rd#?"
QUOTED = "p%40ss%2Fw%3Ard%23%3F"
MODELS = 'models: {m: {endpoints: [{url: "http://127.0.0.1:9", max_concurrency: 1}]}}\n'


def test_several_sentinels_a_database_and_a_password() -> None:
    url = f"redis+sentinel://:{QUOTED}@10.0.0.1:26380,sentinel-b,[::1]:5000/main-store/3"
    assert parse(url) == SentinelURL(
        (("10.0.0.1", 26380), ("sentinel-b", 26379), ("::1", 5000)),
        "main-store", 3, None, SECRET,
    )  # fmt: skip


def test_a_user_and_the_default_database() -> None:
    assert parse("redis+sentinel://gw:pw@h:1/m") == SentinelURL((("h", 1),), "m", 0, "gw", "pw")
    assert parse("redis+sentinel://h:1/m/") == SentinelURL((("h", 1),), "m", 0)


@pytest.mark.parametrize(
    "tail",
    ["h:1", "h:1/", "h:1/m/x", "h:1/m/0/1", "h:1/m?ssl=1", "h:0/m", "h:x/m", "h:1,/m",
     "h:1,:2/m", "h:99999/m"],
)  # fmt: skip
def test_a_bad_form_is_a_config_error_that_never_shows_the_password(tail: str) -> None:
    url = f"redis+sentinel://:{QUOTED}@{tail}"
    with pytest.raises(ValueError) as caught:
        parse(url)
    assert SECRET not in str(caught.value) and QUOTED not in str(caught.value)
    text = f'redis: {{url: "{url}"}}\n' + MODELS
    with pytest.raises(ConfigError) as config:
        parse_config(text, "g.yaml")
    assert "redis.url" in str(config.value)
    assert SECRET not in str(config.value) and QUOTED not in str(config.value)


def test_a_raw_slash_in_the_password_is_not_quoted_back() -> None:
    with pytest.raises(ValueError) as caught:
        parse("redis+sentinel://:sec/ret@h:1/m")
    assert "sec" not in str(caught.value)


def test_a_good_url_passes_the_config() -> None:
    text = 'redis: {url: "redis+sentinel://:pw@a:1,b:2/m/1"}\n' + MODELS
    assert parse_config(text, "g.yaml").redis.url.startswith("redis+sentinel://")


def test_what_a_failed_lookup_means() -> None:
    named = cause_of(UnknownMaster("the sentinels know no master named 'm'"))
    assert (named.kind, named.misconfigured) == ("no_master", True)
    assert named.text == "redis: the sentinels know no master named 'm'"
    assert named.public == "redis: the sentinels know no master of that name"
    silent = cause_of(NoSentinel("no sentinel answered (refused)"))
    assert (silent.kind, silent.misconfigured) == ("unreachable", False)
    assert silent.public == "redis: unreachable"
    # A master with min-replicas-to-write whose replica was promoted: an outage, said so.
    alone = cause_of(ResponseError("NOREPLICAS Not enough good replicas to write. script: 0"))
    assert (alone.kind, alone.misconfigured) == ("no_replicas", False)
    assert alone.public == "redis: the master refuses writes (too few replicas)"


async def test_no_sentinel_answering_is_said_within_the_bound() -> None:
    lookup = Sentinels(parse(f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:1/m"), 2.0)
    try:
        with pytest.raises(NoSentinel):
            await lookup.locate()
    finally:
        await lookup.aclose()


@pytest.fixture
async def follow() -> AsyncIterator[list[RespClient]]:
    made: list[RespClient] = []
    yield made
    for client in made:
        await client.aclose()


def _client(locator: Locator, made: list[RespClient]) -> RespClient:
    client = RespClient("redis://master/0", locator=locator, watch_s=0.02, command_timeout_s=2)
    made.append(client)
    return client


async def test_the_client_connects_where_the_locator_says(
    two: tuple[RedisServer, RedisServer], follow: list[RespClient]
) -> None:
    locator = Locator(two[0].port)
    client = _client(locator, follow)
    assert await client.send([["SET", "k", "a"], ["GET", "k"]]) == [b"OK", b"a"]
    assert _get(two[0], "k") == b"a"


async def test_a_replica_named_as_master_is_not_used(
    two: tuple[RedisServer, RedisServer], follow: list[RespClient]
) -> None:
    with redis.Redis(port=two[1].port) as replica:
        replica.execute_command("REPLICAOF", "127.0.0.1", str(two[0].port))
    client = _client(Locator(two[1].port), follow)
    with pytest.raises(NotSent) as caught:
        await client.send([["SET", "k", "b"]])
    assert isinstance(caught.value.__cause__, Demoted)
    assert "not a master (slave)" in str(caught.value)
    assert cause_of(caught.value).kind == "unreachable"  # an outage while it moves


async def test_a_readonly_reply_drops_the_connection_and_the_next_call_asks_again(
    two: tuple[RedisServer, RedisServer], follow: list[RespClient]
) -> None:
    locator = Locator(two[0].port)
    client = _client(locator, follow)
    assert await client.send([["SET", "k", "a"]]) == [b"OK"]
    asked = locator.asked
    # Demoted under the open connection (Sentinel's failover keeps it open for seconds).
    with redis.Redis(port=two[0].port) as old:
        old.execute_command("REPLICAOF", "127.0.0.1", str(two[1].port))
    with pytest.raises(Demoted):  # an outage answer, never a silent success
        await client.send([["SET", "k", "c"]])
    locator.port = two[1].port
    assert await client.send([["SET", "k", "d"]]) == [b"OK"]
    assert locator.asked > asked
    assert _get(two[1], "k") == b"d"


async def test_another_master_named_by_the_locator_is_followed(
    two: tuple[RedisServer, RedisServer], follow: list[RespClient]
) -> None:
    locator = Locator(two[0].port)
    client = _client(locator, follow)
    assert await client.send([["SET", "k", "a"]]) == [b"OK"]
    locator.port = two[1].port  # the old master still answers as one: only the watch can tell
    deadline = time.monotonic() + 10
    while _get(two[1], "k") != b"moved":  # the watch runs every 20 ms: a bounded poll for it
        assert time.monotonic() < deadline, "the client never moved"
        with contextlib.suppress(RedisConnectionError):  # the call the drop cut short
            await client.send([["SET", "k", "moved"]])
        await asyncio.sleep(0.02)
    assert locator.asked >= 2


def _get(server: RedisServer, key: str) -> bytes | None:
    with redis.Redis(port=server.port) as plain:
        value: bytes | None = plain.get(key)
        return value


async def test_redis_py_pools_follow_too_a_subscription_included(
    two: tuple[RedisServer, RedisServer],
) -> None:
    locator = Locator(two[0].port)
    client = _Sentinel(locator).master_for("m", connection_pool_class=FollowingPool)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    try:
        await client.set("k", "a")
        await pubsub.subscribe("wake")
        locator.port = two[1].port  # the pool's watch runs every WATCH_S
        deadline = time.monotonic() + 10
        while _get(two[1], "k") != b"moved":  # a bounded poll for the watch
            assert time.monotonic() < deadline, "the pool never moved"
            with contextlib.suppress(RedisConnectionError):
                await client.set("k", "moved")
            await asyncio.sleep(0.02)
        heard = None
        while heard is None:  # what the new master publishes reaches the subscription
            assert time.monotonic() < deadline, "the subscription never moved"
            with redis.Redis(port=two[1].port) as new:
                new.publish("wake", "w1 http://e")
            try:
                heard = await pubsub.get_message(timeout=0.05)
            except RedisConnectionError:  # broken by the move: the keeper subscribes again
                await pubsub.subscribe("wake")
    finally:
        with contextlib.suppress(RedisConnectionError):
            await pubsub.aclose()
        await client.aclose()
    assert heard["data"] == b"w1 http://e"
