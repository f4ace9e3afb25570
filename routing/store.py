"""The connection to the shared store (Redis), or an in-process stand-in for `memory://`;
the `Store` where admission scripts run, whichever client carries it; and the probe that
asks the store whether the gateway can use it (at start and on /readyz)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.exceptions import DataError, NoScriptError, RedisError

from routing import sentinel
from routing.resp import RespClient
from routing.storeerrors import Cause, cause_of
from routing.wire import Command, keepalive_options

# redis-py connections per process. The hot path of redis:// and unix:// needs none (one
# pipelining connection); rediss:// runs admission through this pool, and a call finding all
# of them busy waits for one (within the command timeout) instead of failing as an outage.
MAX_CONNECTIONS = 512
# memory://: connections are objects in this process, so none is ever refused (redis-py's
# default pool refuses the 101st at once, which read as an outage in the demo).
UNBOUNDED = 2**31
# A connection's setup (and, behind Sentinel, the lookup of the master) gives up after this.
CONNECT_TIMEOUT_S = 2.0
# A script that cannot exist: running it answers NOSCRIPT where scripts may run.
PROBE_SHA = "0" * 40


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


class Store(Protocol):
    """Where admission scripts run (routing/scripts.py): `RespClient`, or `RedisPyStore`."""

    def send(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        """Send the commands in one round trip, now; the future gets one reply per command,
        a command's own error reply as an exception object in its place. A lost connection
        or a missed deadline fails the whole future; an argument that cannot be encoded
        fails it with `DataError` (nothing was sent)."""
        ...

    async def aclose(self) -> None: ...


class RedisPyStore:
    """The `Store` over redis-py (memory://, rediss://): each send is one non-transactional
    pipeline, bounded as a whole by `timeout_s` (None for memory://, see `call_timeout`).
    The client is its owner's: `aclose` leaves it open."""

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
                    pipe.execute_command(*command)
                return list(await pipe.execute(raise_on_error=False))
        except UnicodeError as exc:  # raised before anything is written: not an outage
            raise DataError(f"cannot encode a Redis argument: {exc}") from exc

    async def aclose(self) -> None:
        pass


def script_store(url: str, client: aioredis.Redis, command_timeout_s: float) -> Store:
    """Where admission scripts run: the lean pipelining client for redis://, unix:// and
    redis+sentinel:// (on the master the sentinels name), else (memory://, rediss://) the
    redis-py `client`."""
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
    return aioredis.Redis.from_url(url, **_options(socket_timeout=None))


def _options(*, socket_timeout: float | None) -> dict[str, Any]:
    return {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": socket_timeout,
        "socket_keepalive": True,
        "socket_keepalive_options": keepalive_options(),
        "health_check_interval": 15,
    }


async def probe(
    client: aioredis.Redis, timeout_s: float | None, *, scripts: bool = True
) -> Cause | None:
    """Why the gateway cannot use this store now, or None. One round trip: connecting
    tests the password and the TLS certificate; ROLE tells a Sentinel or a replica from a
    master; with `scripts`, running a script that does not exist answers NOSCRIPT where
    this user may run scripts (else NOPERM, or an unknown command on a Sentinel). Redis
    counts that NOSCRIPT as a failed call, so frequent probes leave it out."""
    try:
        async with asyncio.timeout(timeout_s):
            pipe = client.pipeline(transaction=False)
            pipe.execute_command("ROLE")
            if scripts:
                pipe.execute_command("EVALSHA", PROBE_SHA, 0)
            role, *script = await pipe.execute(raise_on_error=False)
    except TimeoutError:
        return Cause("timeout", f"redis: no answer within {timeout_s or 0:g} s")
    except (RedisError, OSError) as exc:
        return cause_of(exc)
    return _not_master(role) or (_refused(script[0]) if script else None)


def _not_master(role: Any) -> Cause | None:
    # An error (a user without ROLE, or fakeredis) leaves it to the script probe.
    if isinstance(role, Exception) or not isinstance(role, list) or not role:
        return None
    name = _text(role[0])
    if name == "sentinel":
        return Cause("not_master", "redis: not a master (sentinel)")
    if name in ("slave", "replica"):
        master = f" of {_text(role[1])}:{role[2]}" if len(role) > 2 else ""
        return Cause("not_master", f"redis: not a master (replica{master})")
    return None


def _refused(reply: Any) -> Cause | None:
    if not isinstance(reply, Exception) or isinstance(reply, NoScriptError):
        return None
    return cause_of(reply)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def start_problem(url: str, command_timeout_s: float) -> Cause | None:
    """A misconfiguration that must stop `gateway serve` at once (wrong password, missing
    permission, refused certificate, not a master), or None. A store that cannot be reached
    now is None too: an outage may heal, and `redis.on_outage` answers meanwhile."""
    if url.startswith("memory://"):
        return None

    async def check() -> Cause | None:
        client = connect(url, command_timeout_s=command_timeout_s)
        try:
            return await probe(client, 2.0 + command_timeout_s)  # a connect, then a reply
        finally:
            await client.aclose()

    cause = asyncio.run(check())
    return cause if cause is not None and cause.misconfigured else None
