"""Redis behind Sentinel: `redis+sentinel://[[user]:password@]host:port[,host:port...]/<master>[/<db>]`.

The password (and user) are the data nodes' (the master's); the sentinels are asked without
one. The master's address comes from the sentinels, each asked in turn
(`SENTINEL get-master-addr-by-name`), the first answer winning, all of it bounded by the
connect timeout; it is asked again at every (re)connect. A failover is followed, not only
when the old master's connections break: Sentinel leaves a demoted master accepting writes
for seconds after the new one is named (it reconfigures it later), so while connected each
client asks the sentinels every `WATCH_S` and drops its connections when they name another
master. A READONLY reply drops the connection too (routing/store/resp.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from routing.store.resp import Locator, RespClient

SCHEME = "redis+sentinel://"
DEFAULT_PORT = 26379
# How often a connected client asks the sentinels whether the master moved.
WATCH_S = 0.5


class UnknownMaster(MasterNotFoundError):
    """The sentinels answered, and know no master of that name: a misconfiguration."""


class NoSentinel(MasterNotFoundError):
    """No sentinel answered: an outage (it may heal)."""


@dataclass(frozen=True, slots=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def is_sentinel(url: str) -> bool:
    return url.startswith(SCHEME)


def parse(url: str) -> SentinelURL:
    """The parts of a sentinel URL; a `ValueError` that never quotes the credentials."""
    if not is_sentinel(url):
        raise ValueError(f"a sentinel URL starts with {SCHEME}")
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError("cannot be parsed as a sentinel URL") from None
    if parts.query or parts.fragment:
        raise ValueError("a sentinel URL takes no ?options or #fragment")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    path = parts.path.split("/")[1:]
    if len(path) not in (1, 2) or not path[0]:
        raise ValueError("a sentinel URL ends with /<master name>[/<db>]")
    db = path[1] if len(path) == 2 and path[1] else "0"
    if not db.isdigit():
        raise ValueError("the database after the master name is a number")
    return SentinelURL(
        tuple(_address(h) for h in hosts.split(",")),
        unquote(path[0]),
        int(db),
        unquote(username) if at and username else None,
        unquote(password) if at and password else None,
    )


def _address(text: str) -> tuple[str, int]:
    host, port = text, str(DEFAULT_PORT)
    if text.startswith("["):  # [::1]:26379
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else port
    elif ":" in text:
        host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("each sentinel address is host:port")  # not quoted: may hold a secret
    return host, int(port)


class Sentinels:
    """Asks the sentinels of one URL where its master is."""

    def __init__(self, spec: SentinelURL, timeout_s: float) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        # Each gets its share of the whole bound, and one try: a stalled or refusing
        # sentinel leaves time to ask the next one.
        each = timeout_s / len(spec.sentinels)
        self._clients = [
            aioredis.Redis(host=h, port=p, socket_timeout=each, socket_connect_timeout=each,
                           retry=Retry(NoBackoff(), 0))
            for h, p in spec.sentinels
        ]  # fmt: skip

    async def locate(self) -> tuple[str, int]:
        """The master's (host, port): the first sentinel that knows it wins."""
        unknown, failed = 0, ""
        try:
            async with asyncio.timeout(self.timeout_s):
                for n, client in enumerate(self._clients):
                    try:
                        reply = await client.execute_command(  # type: ignore[no-untyped-call]
                            "SENTINEL", "get-master-addr-by-name", self.spec.master
                        )
                    except (RedisError, OSError) as exc:
                        failed = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                        continue
                    if not reply:
                        unknown += 1
                        continue
                    if n:  # the one that answered is asked first from now on
                        self._clients.insert(0, self._clients.pop(n))
                    return _text(reply[0]), int(reply[1])
        except TimeoutError:
            failed = f"no answer within {self.timeout_s:g} s"
        if unknown:
            raise UnknownMaster(f"the sentinels know no master named {self.spec.master!r}")
        raise NoSentinel(f"no sentinel answered ({failed})")

    async def aclose(self) -> None:
        for client in self._clients:
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Sentinel(Sentinel):
    """redis-py's Sentinel, asking through `Sentinels` (one lookup, one set of errors)."""

    def __init__(self, sentinels: Locator, **connection_kwargs: Any) -> None:
        # (Through Any: redis-py's releases differ on whether this __init__ is typed.)
        init: Any = super().__init__
        init([], **connection_kwargs)
        self.lookup = sentinels

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        return await self.lookup.locate()


class FollowingPool(SentinelConnectionPool):
    """redis-py's pool for the master, which also asks the sentinels every `WATCH_S` while
    it has connections, and drops them all (in use too: a subscription) when the master
    moved. Closing it closes the sentinel connections too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._watch: asyncio.Task[None] | None = None

    async def get_master_address(self) -> tuple[str, int]:
        before = self.master_address
        address: tuple[str, int] = await super().get_master_address()  # type: ignore[no-untyped-call]
        if before is not None and address != before:  # redis-py drops only idle ones
            await self._drop_all()
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._follow())
        return address

    async def _follow(self) -> None:
        lookup: Locator = self.sentinel_manager.lookup
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                address = await lookup.locate()
            except (RedisError, OSError):
                continue  # no answer: keep what is connected
            if self.master_address is not None and address != self.master_address:
                self.master_address = address
                await self._drop_all()

    async def _drop_all(self) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self.disconnect(inuse_connections=True)

    async def aclose(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await super().aclose()
        await self.sentinel_manager.lookup.aclose()


def master_client(url: str, connect_timeout_s: float, **options: Any) -> aioredis.Redis:
    """A redis-py client of the master of a sentinel URL (`options` as for a redis:// one)."""
    spec = parse(url)
    manager = _Sentinel(Sentinels(spec, connect_timeout_s))
    client: aioredis.Redis = manager.master_for(
        spec.master, connection_pool_class=FollowingPool, db=spec.db,
        username=spec.username, password=spec.password, **options,
    )  # fmt: skip
    return client


def script_client(url: str, connect_timeout_s: float, command_timeout_s: float) -> RespClient:
    """The lean pipelining client (routing/store/resp.py) on the master of a sentinel URL."""
    spec = parse(url)
    user = quote(spec.username or "", safe="")
    auth = f"{user}:{quote(spec.password, safe='')}@" if spec.password is not None else ""
    return RespClient(
        f"redis://{auth}master/{spec.db}",  # the host is the locator's answer
        locator=Sentinels(spec, connect_timeout_s), watch_s=WATCH_S,
        connect_timeout_s=connect_timeout_s, command_timeout_s=command_timeout_s,
    )  # fmt: skip
