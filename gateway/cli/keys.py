"""`gateway keys create`: mint an API key, store its digest in Redis, print the key once."""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
from collections.abc import Coroutine
from typing import Any

from redis.exceptions import RedisError

from gateway.runtime.settings import digest_key, load_config
from routing.store.causes import cause_of
from tiers.policy import Tier


def keys_create(args: argparse.Namespace) -> int:
    from gateway.runtime.auth import KEY_PREFIX, create_key
    from routing.store.connect import connect

    config = load_config(args.config)
    if config.redis.url.startswith("memory://"):
        # The store lives inside one gateway process: the key goes into the config instead.
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        print(key)
        print(
            "# memory:// keeps no keys from outside its process: add this to the config's keys:\n"
            f"#   - {{sha256: {digest_key(key)}, account: {args.account}, "
            f"max_concurrency: {args.max_concurrency}, weight: {args.weight:g}{_limits(args)}}}",
            file=sys.stderr,
        )
        return 0

    async def create() -> str:
        redis = connect(config.redis.url, command_timeout_s=config.redis.command_timeout_s)
        try:
            tiers = [Tier(t) for t in args.tiers] if args.tiers else None
            return await create_key(
                redis, args.account, max_concurrency=args.max_concurrency, weight=args.weight,
                models=args.models, tiers=tiers, rpm=args.rpm, tpm=args.tpm,
            )  # fmt: skip
        finally:
            await redis.aclose()

    try:
        key = _run(create())
    except (RedisError, OSError) as exc:
        print(f"gateway keys create: {cause_of(exc).text}", file=sys.stderr)
        return 1
    print(key)
    print(f"# account {args.account}, key id {digest_key(key)[:12]}; shown once", file=sys.stderr)
    return 0


def _limits(args: argparse.Namespace) -> str:
    """The key's rate limits as the config entry's last keys ("" without any)."""
    given = (("rpm", args.rpm), ("tpm", args.tpm))
    return "".join(f", {name}: {value}" for name, value in given if value is not None)


def _run(coro: Coroutine[Any, Any, str]) -> str:
    return asyncio.run(coro)
