"""Who is calling: API key from the request headers -> Account.

Keys are only ever held as SHA-256 digests (from config, or from Redis where
`gateway keys create` writes them). A digest is looked up by value, then compared with
`hmac.compare_digest`; the lookup itself leaks nothing useful because an attacker controls
the key, not its digest. Redis lookups are cached briefly so a request costs no round trip.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.errors import AuthenticationFailed, ServiceUnavailable
from gateway.runtime.settings import (
    MAX_RPM,
    MAX_TPM,
    MAX_WEIGHT,
    AccountConfig,
    KeyConfig,
    digest_key,
)
from routing.admission.ratelimit import RateLimits, rate_limits
from routing.errors import UnavailableReason
from routing.store.causes import StoreErrors
from routing.store.keys import API_KEYS_HASH as KEYS_HASH
from tiers.policy import Tier

KEY_PREFIX = "gw-"


@dataclass(frozen=True, slots=True)
class Account:
    name: str
    # The digest's first 12 hex digits: enough to tell keys apart in records, useless to forge.
    key_id: str
    digest: str
    max_concurrency: int
    models: frozenset[str] | None
    tiers: frozenset[Tier] | None
    # Its share when several accounts wait in one tier of a model (fair share).
    weight: float = 1.0
    # Rate limits per minute (None: none): the key's own, and its account's (config
    # `accounts:`, by name), requests and tokens (prompt + completion).
    rpm: int | None = None
    tpm: int | None = None
    account_rpm: int | None = None
    account_tpm: int | None = None
    # All four as admission takes them (None: no limit at all, nothing to check).
    rates: RateLimits | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        limits = (self.rpm, self.tpm, self.account_rpm, self.account_tpm)
        object.__setattr__(self, "rates", rate_limits(self.name, self.key_id, *limits))


def account_from_config(key: KeyConfig, whole: AccountConfig | None = None) -> Account:
    """The key's account; `whole`: the account's own limits (config `accounts:`)."""
    return Account(
        name=key.account,
        key_id=key.sha256[:12],
        digest=key.sha256,
        max_concurrency=key.max_concurrency,
        models=frozenset(key.models) if key.models is not None else None,
        tiers=frozenset(key.tiers) if key.tiers is not None else None,
        weight=key.weight,
        rpm=key.rpm,
        tpm=key.tpm,
        account_rpm=whole.rpm if whole is not None else None,
        account_tpm=whole.tpm if whole is not None else None,
    )


def key_from_headers(
    authorization: str | None, x_api_key: str | None, xi_api_key: str | None
) -> str | None:
    """The caller's key, looked for in documented order: Bearer, x-api-key, xi-api-key."""
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    if x_api_key and x_api_key.strip():
        return x_api_key.strip()
    if xi_api_key and xi_api_key.strip():
        return xi_api_key.strip()
    return None


class KeyStore:
    """Authenticates keys against config digests and the Redis hash `gw:keys`; `accounts`:
    the accounts' own limits (config `accounts:`), for keys of both kinds."""

    def __init__(
        self,
        configured: Iterable[KeyConfig],
        redis: aioredis.Redis,
        *,
        accounts: Mapping[str, AccountConfig] | None = None,
        ttl_s: float = 10.0,
        negative_ttl_s: float = 2.0,
        max_cached: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        store_errors: StoreErrors | None = None,
    ) -> None:
        self._accounts = dict(accounts or {})
        self._configured = {
            k.sha256: account_from_config(k, self._accounts.get(k.account)) for k in configured
        }
        self._redis = redis
        self._ttl = ttl_s
        self._negative_ttl = negative_ttl_s
        self._max_cached = max_cached
        self._clock = clock
        self._cache: OrderedDict[str, tuple[float, Account | None]] = OrderedDict()
        self._store_errors = store_errors if store_errors is not None else StoreErrors()

    async def authenticate(self, key: str | None) -> Account:
        if not key or len(key) > 512:
            raise AuthenticationFailed()
        digest = digest_key(key)
        account = self._configured.get(digest)
        if account is None:
            account = await self._stored(digest)
        if account is None or not hmac.compare_digest(account.digest, digest):
            raise AuthenticationFailed()
        return account

    async def _stored(self, digest: str) -> Account | None:
        now = self._clock()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            raw = await self._redis.hget(KEYS_HASH, digest)
        except RedisError as exc:
            self._store_errors.report(exc, "keys", refused=True)
            raise ServiceUnavailable(
                "The key store is unreachable; try again shortly.",
                reason=UnavailableReason.KEY_STORE_UNREACHABLE,
            ) from exc
        account = _account_from_record(digest, raw, self._accounts) if raw is not None else None
        ttl = self._ttl if account is not None else self._negative_ttl
        self._cache[digest] = (now + ttl, account)
        self._cache.move_to_end(digest)
        while len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return account


def _account_from_record(
    digest: str, raw: bytes | str, accounts: Mapping[str, AccountConfig]
) -> Account:
    record = orjson.loads(raw)
    models = record.get("models")
    tiers = record.get("tiers")
    name = str(record["account"])
    whole = accounts.get(name)
    return Account(
        name=name,
        key_id=digest[:12],
        digest=digest,
        max_concurrency=int(record.get("max_concurrency", 200)),
        models=frozenset(models) if models is not None else None,
        tiers=frozenset(Tier(t) for t in tiers) if tiers is not None else None,
        weight=_weight(record.get("weight", 1)),
        rpm=_limit(record.get("rpm"), MAX_RPM),
        tpm=_limit(record.get("tpm"), MAX_TPM),
        account_rpm=whole.rpm if whole is not None else None,
        account_tpm=whole.tpm if whole is not None else None,
    )


def _limit(value: object, most: int) -> int | None:
    """A stored key's rate limit; absent, or out of range (written by hand): none."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        return None
    return value


def _weight(value: object) -> float:
    """A stored key's weight; one out of range (written by hand) counts as the default."""
    try:
        weight = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 1.0
    return weight if 0 < weight <= MAX_WEIGHT else 1.0


async def create_key(
    redis: aioredis.Redis,
    account: str,
    *,
    max_concurrency: int = 200,
    weight: float = 1.0,
    models: list[str] | None = None,
    tiers: list[Tier] | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
) -> str:
    """Mint a key, store only its digest, and return the key (shown to the operator once)."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    record = {
        "account": account,
        "max_concurrency": max_concurrency,
        "weight": weight,
        "models": models,
        "tiers": [t.value for t in tiers] if tiers is not None else None,
        "rpm": rpm,
        "tpm": tpm,
        "created": int(time.time()),
    }
    await redis.hset(KEYS_HASH, digest_key(key), orjson.dumps(record))
    return key
