"""The connection to the shared store (Redis), or an in-process stand-in for `memory://`:
redis-py's clients (single Redis, Sentinel, Cluster), the client admission's scripts run on
(`script_store`), and the one pub/sub subscription's client."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

import redis
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import BlockingConnectionPool
from redis.exceptions import DataError, RedisError

from routing.store import sentinel
from routing.store.base import Store
from routing.store.causes import cause_of
from routing.store.cluster import ClusterStore
from routing.store.resp import RespClient
from routing.store.wire import Command, fold, keepalive_options, unfolded

log = logging.getLogger("gateway.store")

# redis-py connections per process. The hot path of redis:// and unix:// needs none (one
# pipelining connection); rediss:// runs admission through this pool, and a call finding all
# of them busy waits for one (within the command timeout) instead of failing as an outage.
MAX_CONNECTIONS = 512
# memory://: connections are objects in this process, so none is ever refused (redis-py's
# default pool refuses the 101st at once, which read as an outage in the demo).
UNBOUNDED = 2**31
# A connection's setup (and, behind Sentinel, the lookup of the master) gives up after this.
CONNECT_TIMEOUT_S = 2.0


def connect(url: str, *, command_timeout_s: float) -> aioredis.Redis:
    """A client for `url` whose calls give up after `command_timeout_s` (a stalled Redis is
    an outage, not a hang); `memory://` gives fakeredis in this process (one replica only)."""
    if url.startswith("memory://"):
        import fakeredis

        client: Any = fakeredis.FakeAsyncRedis(max_connections=UNBOUNDED)
        return client  # type: ignore[no-any-return]
    if sentinel.is_sentinel(url):
        return sentinel.master_client(
            url, CONNECT_TIMEOUT_S, max_connections=MAX_CONNECTIONS,
            **_options(socket_timeout=command_timeout_s),
        )  # fmt: skip
    if is_cluster(url, command_timeout_s):
        return cluster_client(url, command_timeout_s)
    pool = BlockingConnectionPool.from_url(
        url, max_connections=MAX_CONNECTIONS, timeout=command_timeout_s,
        **_options(socket_timeout=command_timeout_s),
    )  # fmt: skip
    return aioredis.Redis.from_pool(pool)


def call_timeout(url: str, command_timeout_s: float) -> float | None:
    """How long a store call may take before it counts as an outage. memory:// lives in this
    process and cannot stall on its own: a wait for it is a wait for this process's CPU
    (a thousand requests at once take longer than a timeout), never an outage."""
    return None if url.startswith("memory://") else command_timeout_s


class RedisPyStore:
    """The `Store` over redis-py (memory://, rediss://): each send is one non-transactional
    pipeline, bounded as a whole by `timeout_s` (None for memory://, see `call_timeout`).
    The client is its owner's: `aclose` leaves it open."""

    moves: int | None = None
    one_node = True

    def __init__(self, client: aioredis.Redis, timeout_s: float | None) -> None:
        self.client = client
        self.timeout_s = timeout_s

    def send(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        # A task: the pipeline goes out whether or not anyone awaits its replies.
        return asyncio.ensure_future(self._pipeline(commands))

    async def _pipeline(self, commands: Sequence[Command]) -> list[Any]:
        try:
            async with asyncio.timeout(self.timeout_s):
                pipe = self.client.pipeline(transaction=False)
                for command in commands:
                    for one in unfolded(command):
                        pipe.execute_command(*one)
                return fold(commands, list(await pipe.execute(raise_on_error=False)))
        except UnicodeError as exc:  # raised before anything is written: not an outage
            raise DataError(f"cannot encode a Redis argument: {exc}") from exc

    async def aclose(self) -> None:
        pass


def script_store(url: str, client: aioredis.Redis, command_timeout_s: float) -> Store:
    """Where admission scripts run: the lean pipelining client for redis://, unix:// and
    redis+sentinel:// (on the master the sentinels name), else (memory://, rediss://) the
    redis-py `client`; on a Cluster, its own (`cluster_store`)."""
    if isinstance(client, RedisCluster):
        return cluster_store(url, command_timeout_s)
    if RespClient.supports(url):
        return RespClient(url, command_timeout_s=command_timeout_s)
    if sentinel.is_sentinel(url):
        return sentinel.script_client(url, CONNECT_TIMEOUT_S, command_timeout_s)
    return RedisPyStore(client, call_timeout(url, command_timeout_s))


def subscriber(url: str, client: aioredis.Redis) -> aioredis.Redis:
    """A client for the one pub/sub subscription: no socket timeout, so a quiet channel is
    not an error (redis-py #2807); keepalive finds a peer that vanished. memory:// shares
    the in-process server of `client`."""
    if url.startswith("memory://"):
        return client
    if sentinel.is_sentinel(url):
        return sentinel.master_client(url, CONNECT_TIMEOUT_S, **_options(socket_timeout=None))
    if isinstance(client, RedisCluster):
        return cluster_subscriber(url, client)
    return aioredis.Redis.from_url(url, **_options(socket_timeout=None))


def _options(*, socket_timeout: float | None) -> dict[str, Any]:
    return {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": socket_timeout,
        "socket_keepalive": True,
        "socket_keepalive_options": keepalive_options(),
        "health_check_interval": 15,
    }


# --- Redis Cluster (routing/store/cluster.py), detected by itself from any node's address --


def is_cluster(url: str, command_timeout_s: float) -> bool:
    """Whether `url` (redis:// or rediss://) is a node of a Redis Cluster: asked once, when a
    client is made. A node that cannot be reached now counts as a single Redis."""
    if not url.startswith(("redis://", "rediss://")):
        return False
    options = _options(socket_timeout=command_timeout_s)
    try:
        with redis.Redis.from_url(_without_db(url), **options) as client:
            return int(client.info("cluster").get("cluster_enabled", 0)) == 1
    except (RedisError, OSError, ValueError) as exc:  # NOPERM (no INFO): a single Redis
        if (cause := cause_of(exc)).kind in ("unreachable", "timeout"):
            # Were it a Cluster, this process would miss its other nodes until restarted.
            log.warning("redis: taken for a single Redis, not asked whether it is a "
                        "Cluster (%s)", cause.text)  # fmt: skip
        return False


def _without_db(url: str) -> str:
    # A Cluster has db 0 only: a single Redis's db in the URL (its path, or a `?db=` query)
    # would fail the question.
    parsed = urlparse(url)
    query = urlencode([(k, v) for k, v in parse_qsl(parsed.query) if k != "db"])
    return urlunparse(parsed._replace(path="", query=query))


def _node_url(url: str, host: str, port: int) -> str:
    """`url` (its password, TLS options) for another node of the same Cluster."""
    parsed = urlparse(_without_db(url))
    auth = parsed.netloc.rpartition("@")[0]
    netloc = f"{auth}@{host}:{port}" if auth else f"{host}:{port}"
    return urlunparse(parsed._replace(netloc=netloc))


class _ClosingCluster(RedisCluster):
    """redis-py's Cluster client, closed for good: its own `aclose` skips the nodes once a
    failed call marked it for re-initialization (a node down), leaving their sockets open."""

    async def aclose(self) -> None:
        await super().aclose()
        await self.nodes_manager.aclose()
        await self.nodes_manager.aclose("startup_nodes")


def cluster_client(url: str, command_timeout_s: float) -> aioredis.Redis:
    """redis-py's Cluster client, for everything but the scripts (keys, export, probes)."""
    client = _ClosingCluster.from_url(
        _without_db(url), max_connections=MAX_CONNECTIONS,
        **_options(socket_timeout=command_timeout_s),
    )  # fmt: skip
    return client  # type: ignore[return-value]


def cluster_store(url: str, command_timeout_s: float) -> Store:
    """The scripts' store on a Cluster: one lean client per master (redis://), or one
    redis-py client per master (rediss://)."""
    seed = urlparse(url)

    def node(host: str, port: int) -> Store:
        node_url = _node_url(url, host, port)
        if RespClient.supports(node_url):
            return RespClient(node_url, command_timeout_s=command_timeout_s)
        pool = BlockingConnectionPool.from_url(
            node_url, max_connections=MAX_CONNECTIONS, timeout=command_timeout_s,
            **_options(socket_timeout=command_timeout_s),
        )  # fmt: skip
        return _OwnedStore(aioredis.Redis.from_pool(pool), command_timeout_s)

    seeds = [(seed.hostname or "127.0.0.1", seed.port or 6379)]
    return ClusterStore(seeds, node, patience_s=command_timeout_s)


class _OwnedStore(RedisPyStore):
    """A `RedisPyStore` whose client is its own: closed with it."""

    async def aclose(self) -> None:
        await self.client.aclose()


def cluster_subscriber(url: str, client: RedisCluster) -> aioredis.Redis:
    """The pub/sub client on a Cluster: PUBLISH reaches every node, so any node serves the
    subscription. Each new one (after one broke) goes to the next master `client` knows."""
    return _AnyNodeSubscriber(url, client)


class _AnyNodeSubscriber(aioredis.Redis):
    """`pubsub()` on the given node first, then on each master of the Cluster in turn."""

    def __init__(self, url: str, cluster: RedisCluster) -> None:
        super().__init__(connection_pool=self._pool(_without_db(url)))
        self._url, self._cluster, self._turn = url, cluster, 0
        self._pools = {url: self.connection_pool}

    @staticmethod
    def _pool(url: str) -> aioredis.ConnectionPool:
        return aioredis.ConnectionPool.from_url(url, **_options(socket_timeout=None))

    def pubsub(self, **kwargs: Any) -> PubSub:
        masters = [_node_url(self._url, n.host, int(n.port)) for n in self._cluster.get_primaries()]
        urls = list(dict.fromkeys([_without_db(self._url), *masters]))
        url = urls[self._turn % len(urls)]
        self._turn += 1
        if url not in self._pools:
            self._pools[url] = self._pool(url)
        return PubSub(self._pools[url], **kwargs)

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        for pool in self._pools.values():
            await pool.disconnect()
