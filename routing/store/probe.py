"""The probe that asks the store whether the gateway can use it (at start and on /readyz)."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError

from routing.store.causes import Cause, cause_of
from routing.store.connect import connect

# A script that cannot exist: running it answers NOSCRIPT where scripts may run.
PROBE_SHA = "0" * 40


async def probe(
    client: aioredis.Redis, timeout_s: float | None, *, scripts: bool = True
) -> Cause | None:
    """Why the gateway cannot use this store now, or None. One round trip: connecting
    tests the password and the TLS certificate; ROLE tells a Sentinel or a replica from a
    master; with `scripts`, running a script that does not exist answers NOSCRIPT where
    this user may run scripts (else NOPERM, or an unknown command on a Sentinel). Redis
    counts that NOSCRIPT as a failed call, so frequent probes leave it out."""
    if isinstance(client, RedisCluster):
        return await probe_cluster(client, timeout_s, scripts=scripts)
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


async def probe_cluster(
    client: RedisCluster, timeout_s: float | None, *, scripts: bool = True
) -> Cause | None:
    """`probe` on a Cluster: every master must be reachable, a master, able to run
    scripts, and see the cluster as ok."""
    try:
        async with asyncio.timeout(timeout_s):
            await client.initialize()
            # Every node's answer, even after one failed: none is left holding a connection.
            causes = await asyncio.gather(
                *(_probe_node(client, n, scripts) for n in client.get_primaries()),
                return_exceptions=True,
            )
    except TimeoutError:
        return Cause("timeout", f"redis: no answer within {timeout_s or 0:g} s")
    except (RedisError, OSError) as exc:
        return cause_of(exc)
    for cause in causes:
        if isinstance(cause, (RedisError, OSError)):
            return cause_of(cause)
        if isinstance(cause, BaseException):
            raise cause
        if cause is not None:
            return cause
    return None


async def _probe_node(client: RedisCluster, node: Any, scripts: bool) -> Cause | None:
    info = await client.execute_command("CLUSTER INFO", target_nodes=node)
    state = _text(info.get("cluster_state", "")) if isinstance(info, dict) else ""
    if state != "ok":
        return Cause("unreachable", f"redis: cluster state {state or 'unknown'} ({node.name})")
    role = await client.execute_command("ROLE", target_nodes=node)
    if (cause := _not_master(role)) is not None or not scripts:
        return cause
    try:
        await client.execute_command("EVALSHA", PROBE_SHA, 0, target_nodes=node)
    except NoScriptError:
        return None
    except RedisError as exc:
        return cause_of(exc)
    return None
