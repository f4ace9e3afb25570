"""The Cluster store (routing/store/cluster.py) against a real 3-master Redis Cluster: slot
routing, batches split per node and put back in order, scripts on every master, MOVED and
ASK followed, a failed part failing the batch; and the detection in routing/store/connect.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, ResponseError

from routing.store.base import Store
from routing.store.cluster import ClusterStore
from routing.store.connect import (
    _node_url,
    _without_db,
    connect,
    is_cluster,
    script_store,
    subscriber,
)
from routing.store.probe import probe, start_problem
from routing.store.resp import NotSent, RespClient
from routing.store.scripts import Scripts
from routing.store.slotmap import ANY, EVERY, redirect_of, slot_of
from routing.store.wire import Command, Transaction
from tests.conftest import REDIS_URL
from tests.redis_cluster import RedisCluster, start_cluster
from tests.redis_server import RedisServer, self_signed

T = TypeVar("T")


async def bounded(awaitable: Awaitable[T], seconds: float = 10.0) -> T:
    return await asyncio.wait_for(awaitable, seconds)


def tags_on_each_node(cluster: RedisCluster, prefix: str = "t") -> list[str]:
    """One hash tag per master, in the order of `cluster.nodes`."""
    found: dict[int, str] = {}
    for i in range(1000):
        tag = f"{prefix}{i}"
        found.setdefault(cluster.node_of(f"{{{tag}}}").port, tag)
        if len(found) == len(cluster.nodes):
            return [found[n.port] for n in cluster.nodes]
    raise AssertionError("no tag found for some node")


def lean_store(cluster: RedisCluster) -> ClusterStore:
    return ClusterStore(
        [("127.0.0.1", cluster.nodes[0].port)],
        lambda host, port: RespClient(f"redis://{host}:{port}", command_timeout_s=2.0),
    )


@pytest.fixture
async def store(empty_cluster: RedisCluster) -> AsyncIterator[ClusterStore]:
    made = lean_store(empty_cluster)
    try:
        yield made
    finally:
        await made.aclose()


def direct_get(node: RedisServer, key: str) -> bytes | None:
    with redis.Redis(host="127.0.0.1", port=node.port) as client:
        value: bytes | None = client.get(key)
        return value


def test_a_command_goes_to_the_slot_of_its_first_key() -> None:
    assert slot_of(["EVALSHA", "0" * 40, 2, "gw:v2:{m}:leases", "gw:v2:{x}:q", 1]) == slot_of(
        ["GET", "{m}"]
    )
    assert slot_of(["ZREM", "gw:v2:acct:{acme}", "id"]) == slot_of(["GET", "acme"])
    assert slot_of(["EVALSHA", "0" * 40, 0]) == ANY
    assert slot_of(["TIME"]) == ANY
    assert slot_of(["SCRIPT", "LOAD", "return 1"]) == EVERY
    assert slot_of([b"xadd", "{usage}", "*", "a", "b"]) == slot_of(["GET", "usage"])


def test_redirect_replies_are_read() -> None:
    assert redirect_of(ResponseError("MOVED 3999 127.0.0.1:6381")) == (
        "MOVED",
        3999,
        ("127.0.0.1", 6381),
    )
    assert redirect_of(ResponseError("ASK 1 ::1:7000")) == ("ASK", 1, ("::1", 7000))
    assert redirect_of(ResponseError("TRYAGAIN Multiple keys request")) == ("TRYAGAIN", -1, None)
    assert redirect_of(ResponseError("ERR wrong")) is None
    assert redirect_of(b"MOVED 1 a:1") is None


async def test_a_batch_is_split_per_node_and_its_replies_come_back_in_order(
    store: ClusterStore, empty_cluster: RedisCluster
) -> None:
    tags = tags_on_each_node(empty_cluster)
    keys = [f"gw:v2:{{{t}}}:k" for t in tags]
    commands: list[Command] = [["SET", k, f"v{i}"] for i, k in enumerate(keys)]
    commands += [["TIME"], ["INCR", keys[0]]] + [["GET", k] for k in reversed(keys)]
    replies = await bounded(store.send(commands))
    assert replies[:3] == [b"OK"] * 3
    assert isinstance(replies[3], list)  # TIME, from whichever node
    assert isinstance(replies[4], ResponseError)  # its own error reply, in its place
    assert replies[5:] == [b"v2", b"v1", b"v0"]
    for i, (node, key) in enumerate(zip(empty_cluster.nodes, keys, strict=True)):
        assert direct_get(node, key) == f"v{i}".encode()  # each on the node of its slot


async def test_scripts_are_loaded_on_every_master(
    store: ClusterStore, empty_cluster: RedisCluster
) -> None:
    scripts = Scripts()
    await bounded(scripts.load(store))
    for node in empty_cluster.nodes:
        with redis.Redis(host="127.0.0.1", port=node.port) as client:
            assert all(client.script_exists(*scripts.loaded.values()))
    tags = tags_on_each_node(empty_cluster)
    calls = [("account", [f"gw:v2:acct:{{{t}}}"], ["lease-1", 5, 60_000]) for t in tags]
    assert await bounded(scripts.send(store, calls)) == [1, 1, 1]


async def test_scripts_lost_by_one_node_are_loaded_again(
    store: ClusterStore, empty_cluster: RedisCluster
) -> None:
    scripts = Scripts()
    await bounded(scripts.load(store))
    with redis.Redis(host="127.0.0.1", port=empty_cluster.nodes[1].port) as client:
        client.script_flush()  # that node restarted empty, say
        client.function_flush()
    tags = tags_on_each_node(empty_cluster)
    calls = [("account", [f"gw:v2:acct:{{{t}}}"], ["lease-1", 5, 60_000]) for t in tags]
    assert await bounded(scripts.send(store, calls)) == [1, 1, 1]


async def test_a_moved_slot_is_followed_and_learned(
    store: ClusterStore, empty_cluster: RedisCluster
) -> None:
    tags = tags_on_each_node(empty_cluster, "moved")
    key = f"gw:v2:{{{tags[0]}}}:k"
    slot = empty_cluster.slot(key)
    assert await bounded(store.send([["SET", key, "before"]])) == [b"OK"]
    source, target = empty_cluster.nodes[0], empty_cluster.nodes[2]
    empty_cluster.move_slot(slot, target)
    try:
        other = f"gw:v2:{{{tags[1]}}}:k"
        replies = await bounded(store.send([["GET", key], ["SET", other, "x"], ["SET", key, "a"]]))
        assert replies == [b"before", b"OK", b"OK"]
        assert direct_get(target, key) == b"a"
        await bounded(store.refresh())
        assert store.node_of_slot(slot) == ("127.0.0.1", target.port)
        # Once more, for a batch that goes to one node whole (no split).
        empty_cluster.move_slot(slot, empty_cluster.nodes[1])
        assert await bounded(store.send([["GET", key], ["SET", key, "b"]])) == [b"a", b"OK"]
    finally:
        empty_cluster.move_slot(slot, source)


async def test_a_transaction_runs_whole_on_the_node_of_its_keys_and_follows_a_move(
    store: ClusterStore, empty_cluster: RedisCluster
) -> None:
    """A usage record's first send (routing/ledger/records.py) is a MULTI block: it goes with its
    keys' slot, in a batch split over the nodes, and a MOVED aborts it whole (EXECABORT)
    before it is resent whole to the slot's new master."""
    tags = tags_on_each_node(empty_cluster, "multi")
    key, other = f"gw:v2:{{{tags[0]}}}:k", f"gw:v2:{{{tags[1]}}}:k"
    block = Transaction([("SET", f"gw:v2:{{{tags[0]}}}:a", "1"), ("INCR", key)])
    replies = await bounded(store.send([["SET", other, "x"], block, ["GET", key]]))
    assert replies == [b"OK", [b"OK", 1], b"1"]
    slot = empty_cluster.slot(key)
    source, target = empty_cluster.nodes[0], empty_cluster.nodes[2]
    empty_cluster.move_slot(slot, target)
    try:
        replies = await bounded(store.send([block, ["SET", other, "y"]]))
        assert replies == [[b"OK", 2], b"OK"]
        assert direct_get(target, key) == b"2"  # ran once, on the new master
        assert store.redirects["MOVED"] >= 1
    finally:
        empty_cluster.move_slot(slot, source)


async def test_a_slot_being_migrated_is_followed_with_asking(
    store: ClusterStore, empty_cluster: RedisCluster
) -> None:
    tags = tags_on_each_node(empty_cluster, "ask")
    kept, new = f"gw:v2:{{{tags[0]}}}:kept", f"gw:v2:{{{tags[0]}}}:new"
    slot = empty_cluster.slot(kept)
    assert await bounded(store.send([["SET", kept, "1"]])) == [b"OK"]
    target = empty_cluster.nodes[1]
    source = empty_cluster.begin_move(slot, target)
    try:
        # The key still on the source is served there; one it does not have is asked of
        # the target, which takes it only after ASKING.
        replies = await bounded(store.send([["GET", kept], ["SET", new, "2"]]))
        assert replies == [b"1", b"OK"]
        with redis.Redis(host="127.0.0.1", port=target.port) as client:
            pipe = client.pipeline(transaction=False)
            pipe.execute_command("ASKING")
            pipe.get(new)
            assert pipe.execute()[1] == b"2"
        empty_cluster.migrate_keys(slot, source, target)
        # Every key on the target now: the source answers ASK for both.
        assert await bounded(store.send([["GET", kept], ["GET", new]])) == [b"1", b"2"]
    finally:
        empty_cluster.end_move(slot, target)
        empty_cluster.move_slot(slot, source)


class FailingNode:
    """A node's store that fails every send with `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.sent: list[Sequence[Command]] = []

    def send(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        self.sent.append(commands)
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        future.set_exception(self.error)
        return future

    async def aclose(self) -> None:
        pass


def store_with_failing(cluster: RedisCluster, failing: RedisServer, error: Exception) -> Any:
    def node(host: str, port: int) -> Store:
        if port == failing.port:  # a stand-in: the store only sends to it and closes it
            return cast(Store, FailingNode(error))
        return RespClient(f"redis://{host}:{port}", command_timeout_s=2.0)

    return ClusterStore([("127.0.0.1", cluster.nodes[0].port)], node)


async def test_a_part_that_may_have_run_fails_the_batch_in_doubt(
    empty_cluster: RedisCluster,
) -> None:
    tags = tags_on_each_node(empty_cluster, "fail")
    store = store_with_failing(empty_cluster, empty_cluster.nodes[1], RedisConnectionError("x"))
    try:
        batch = [["SET", f"gw:v2:{{{tags[0]}}}:k", "1"], ["SET", f"gw:v2:{{{tags[1]}}}:k", "1"]]
        with pytest.raises(RedisConnectionError) as failed:
            await bounded(store.send(batch))
        assert not isinstance(failed.value, NotSent)  # the other part ran: in doubt
        assert direct_get(empty_cluster.nodes[0], f"gw:v2:{{{tags[0]}}}:k") == b"1"
    finally:
        await store.aclose()


async def test_a_part_that_never_left_answers_its_commands_with_the_error(
    empty_cluster: RedisCluster,
) -> None:
    tags = tags_on_each_node(empty_cluster, "unsent")
    store = store_with_failing(empty_cluster, empty_cluster.nodes[1], NotSent("refused"))
    try:
        keys = [f"gw:v2:{{{t}}}:k" for t in tags]
        replies = await bounded(store.send([["SET", k, "1"] for k in keys]))
        assert replies[0] == b"OK" and replies[2] == b"OK"
        assert isinstance(replies[1], NotSent)  # in its place: the others are given back
        # A batch wholly on that node never left at all.
        with pytest.raises(NotSent):
            await bounded(store.send([["SET", keys[1], "1"]]))
    finally:
        await store.aclose()


async def test_an_argument_that_cannot_be_encoded_sends_nothing(
    store: ClusterStore, empty_cluster: RedisCluster
) -> None:
    tags = tags_on_each_node(empty_cluster, "enc")
    batch = [["SET", f"gw:v2:{{{tags[0]}}}:k", "1"], ["SET", f"gw:v2:{{{tags[1]}}}:k", "\udcff"]]
    with pytest.raises(DataError):
        await bounded(store.send(batch))
    assert direct_get(empty_cluster.nodes[0], f"gw:v2:{{{tags[0]}}}:k") is None


async def test_an_unreachable_cluster_is_not_sent() -> None:
    store = ClusterStore(
        [("127.0.0.1", 1)],
        lambda host, port: RespClient(f"redis://{host}:{port}", connect_timeout_s=0.5),
    )
    try:
        with pytest.raises(NotSent):
            await bounded(store.send([["GET", "k"]]))
    finally:
        await store.aclose()


# --- detection (routing/store/connect.py) ---------------------------------------------------------


async def test_a_cluster_is_detected_from_any_node(
    empty_cluster: RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    for url in empty_cluster.urls():
        assert is_cluster(url, 1.0)
    assert not is_cluster(REDIS_URL, 1.0)
    assert not is_cluster("redis://127.0.0.1:1", 1.0)  # unreachable: as a single Redis
    assert "taken for a single Redis, not asked whether" in caplog.text  # and said so
    url = empty_cluster.urls()[2]
    client = connect(url, command_timeout_s=1.0)
    store = script_store(url, client, 1.0)
    listener = subscriber(url, client)
    try:
        assert isinstance(client, AsyncRedisCluster)
        assert isinstance(store, ClusterStore)
        tags = tags_on_each_node(empty_cluster, "det")
        batch = [["SET", f"gw:v2:{{{t}}}:k", t] for t in tags]
        assert await bounded(store.send(batch)) == [b"OK"] * 3
        assert await bounded(client.get(f"gw:v2:{{{tags[0]}}}:k")) == tags[0].encode()
        assert await bounded(probe(client, 2.0)) is None
    finally:
        await store.aclose()
        await listener.aclose()
        await client.aclose()


async def test_wake_ups_published_on_any_node_reach_the_subscriber(
    empty_cluster: RedisCluster,
) -> None:
    client = connect(empty_cluster.url, command_timeout_s=1.0)
    listener = subscriber(empty_cluster.url, client)
    tags = tags_on_each_node(empty_cluster, "wake")
    channels = [f"gw:v2:{{{t}}}:wake" for t in tags]
    pubsub = listener.pubsub(ignore_subscribe_messages=True)
    try:
        await bounded(pubsub.subscribe(*channels))
        for _ in channels:  # the confirmations: subscribed before anything is published
            assert await bounded(pubsub.get_message(timeout=5.0)) is None
        for node, channel in zip(empty_cluster.nodes, channels, strict=True):
            with redis.Redis(host="127.0.0.1", port=node.port) as direct:
                direct.publish(channel, f"w {channel}")
        got: set[str] = set()
        while len(got) < len(channels):
            message = await bounded(pubsub.get_message(timeout=5.0))
            if message is not None:
                got.add(message["data"].decode())
        assert got == {f"w {c}" for c in channels}
    finally:
        await pubsub.aclose()
        await listener.aclose()
        await client.aclose()


@pytest.fixture
def private_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A cluster of this test alone, to kill a node of."""
    cluster = start_cluster(tmp_path / "cluster")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.slow
async def test_the_probe_fails_while_a_master_is_down(private_cluster: RedisCluster) -> None:
    """A gateway pointed at a live node still cannot serve the models whose slots live on
    a dead one: /readyz and the start say so, not only the requests."""
    client = connect(private_cluster.url, command_timeout_s=1.0)
    try:
        assert await bounded(probe(client, 2.0)) is None
        private_cluster.nodes[2].kill()
        cause = await bounded(probe(client, 2.0))
        assert cause is not None and cause.kind in ("unreachable", "timeout"), cause
        assert not cause.misconfigured  # an outage: `gateway serve` starts and waits
        assert await asyncio.to_thread(start_problem, private_cluster.url, 1.0) is None
    finally:
        await client.aclose()


@pytest.mark.slow
async def test_a_tls_cluster_runs_scripts_through_redis_py_per_node(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path / "tls", tls=self_signed(tmp_path))
    url = cluster.urls()[1]  # rediss://...?ssl_ca_certs=...
    client = connect(url, command_timeout_s=2.0)
    store = script_store(url, client, 2.0)
    try:
        assert isinstance(client, AsyncRedisCluster) and isinstance(store, ClusterStore)
        scripts = Scripts()
        await bounded(scripts.load(store))
        tags = tags_on_each_node(cluster, "tls")
        calls = [("account", [f"gw:v2:acct:{{{t}}}"], ["lease-1", 5, 60_000]) for t in tags]
        assert await bounded(scripts.send(store, calls)) == [1, 1, 1]
        assert await bounded(probe(client, 3.0)) is None
    finally:
        await store.aclose()
        await client.aclose()
        cluster.stop()


def test_a_database_in_the_url_is_left_out_on_a_cluster() -> None:
    assert _node_url("redis://u:p%40ss@h:1/3?db=4&ssl_ca_certs=/c.pem", "n", 2) == (
        "redis://u:p%40ss@n:2?ssl_ca_certs=%2Fc.pem"
    )
    assert _without_db("rediss://h:1/0") == "rediss://h:1"
