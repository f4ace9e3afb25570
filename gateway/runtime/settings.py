"""The gateway's configuration: the YAML of docs/config.md, validated once at start.

`load_config` reads a file, expands `${VAR}` / `${VAR:-default}` inside string values, and
validates it; any problem becomes one `ConfigError` line that names the bad key.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from redis.asyncio.connection import parse_url

from routing.hop.health import HealthSettings
from routing.hop.upstream import UpstreamSettings
from routing.ledger.records import UsageSettings
from routing.registry import MODEL_NAME_PATTERN, ModelConfig, NotBool
from routing.store import sentinel
from tiers.policy import Tier, TiersConfig

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(Exception):
    """A config file that cannot be used; the message is one line naming the problem."""


class ListenConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)


class RedisConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field("redis://127.0.0.1:6379/0", repr=False)
    lease_ttl_s: float = Field(30.0, ge=1.0, le=3600.0)
    # No Redis call waits longer than this; past it the call fails as an outage (docs/config.md).
    command_timeout_s: float = Field(2.0, gt=0.0, le=60.0)
    on_outage: Literal["reject", "local"] = "reject"

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        if sentinel.is_sentinel(url):
            sentinel.parse(url)  # its messages never quote the credentials
            return url
        if not url.startswith(("redis://", "rediss://", "unix://", "memory://")):
            raise ValueError(
                "must start with redis://, rediss://, unix://, redis+sentinel:// or memory://"
            )
        if not url.startswith("memory://"):
            try:
                parse_url(url)
            except ValueError:  # its message may quote a piece of the password: not shown
                raise ValueError(
                    "cannot be parsed as a Redis URL (in a password, write / # ? @ : as "
                    "%2F %23 %3F %40 %3A)"
                ) from None
        return url


class LimitsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024)
    # A worker's SSE event larger than this ends the stream with an SSE error event.
    max_event_bytes: int = Field(1024 * 1024, ge=1024, le=1024 * 1024 * 1024)


# What a browser app's preflight may ask for without a config saying more.
CORS_HEADERS = ("*",)  # "*": the headers the browser names (so Authorization too)
CorsMethod = Literal["GET", "POST", "OPTIONS"]
CORS_METHODS: tuple[CorsMethod, ...] = ("GET", "POST", "OPTIONS")
# Response headers a browser app may read (beside the CORS-safelisted ones).
CORS_EXPOSE = (
    "x-request-id", "retry-after", "x-should-retry",
    "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
)  # fmt: skip
_ORIGIN = re.compile(r"^(\*|https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?)$")


class CorsConfig(BaseModel):
    """Cross-origin calls from browser apps (docs/config.md): off until origins are named."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Exact origins (scheme://host[:port]), or "*" for any.
    allow_origins: tuple[str, ...] = Field((), max_length=256)
    allow_methods: tuple[CorsMethod, ...] = CORS_METHODS
    allow_headers: tuple[str, ...] = Field(CORS_HEADERS, max_length=256)
    expose_headers: tuple[str, ...] = Field(CORS_EXPOSE, max_length=256)
    allow_credentials: bool = False
    max_age_s: int = Field(600, ge=0, le=86_400)

    @field_validator("allow_origins")
    @classmethod
    def _origins(cls, origins: tuple[str, ...]) -> tuple[str, ...]:
        for origin in origins:
            if not _ORIGIN.match(origin):
                raise ValueError(f'{origin[:80]!r} is not "*" nor scheme://host[:port]')
        return tuple(o.lower() for o in origins)

    @field_validator("allow_headers", "expose_headers")
    @classmethod
    def _header_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            if name != "*" and not re.match(r"^[A-Za-z0-9-]{1,64}$", name):
                raise ValueError(f"{name[:80]!r} is not a header name")
        return tuple(n.lower() for n in names)


# The largest key weight (fair share): far past any useful ratio, small enough for Redis.
MAX_WEIGHT = 1_000_000.0
# The largest rate limits, requests and tokens per minute (past them a limit means nothing).
MAX_RPM = 1_000_000_000
MAX_TPM = 1_000_000_000_000


class KeyConfig(BaseModel):
    """An API key as config knows it: only its SHA-256 digest, never the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$", repr=False)
    account: str = Field(min_length=1, max_length=128)
    max_concurrency: Annotated[int, NotBool] = Field(200, ge=1, le=1_000_000)
    # Its share when several accounts wait in one tier of a model (fair share).
    weight: Annotated[float, NotBool] = Field(1.0, gt=0.0, le=MAX_WEIGHT)
    models: tuple[str, ...] | None = None
    tiers: tuple[Tier, ...] | None = None
    # This key's own rate limits: requests and tokens (prompt + completion) per minute.
    rpm: Annotated[int, NotBool] | None = Field(None, ge=1, le=MAX_RPM)
    tpm: Annotated[int, NotBool] | None = Field(None, ge=1, le=MAX_TPM)

    @field_validator("sha256")
    @classmethod
    def _lower(cls, digest: str) -> str:
        return digest.lower()


class AccountConfig(BaseModel):
    """What an account as a whole may use, over all its keys: requests and tokens (prompt +
    completion) per minute."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rpm: Annotated[int, NotBool] | None = Field(None, ge=1, le=MAX_RPM)
    tpm: Annotated[int, NotBool] | None = Field(None, ge=1, le=MAX_TPM)


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    listen: ListenConfig = ListenConfig()
    redis: RedisConfig = RedisConfig()
    limits: LimitsConfig = LimitsConfig()
    upstream: UpstreamSettings = UpstreamSettings()
    health: HealthSettings = HealthSettings()
    usage: UsageSettings = UsageSettings()
    tiers: TiersConfig = TiersConfig()
    models: dict[str, ModelConfig] = Field(min_length=1)
    keys: tuple[KeyConfig, ...] = ()
    # Limits of accounts as a whole, by account name (keys name their account).
    accounts: dict[str, AccountConfig] = {}
    # On SIGTERM: stop taking requests, let those in flight finish for up to this long.
    shutdown_grace_s: float = Field(30.0, ge=0, le=3600)
    cors: CorsConfig = CorsConfig()

    @field_validator("models")
    @classmethod
    def _plain_names(cls, models: dict[str, ModelConfig]) -> dict[str, ModelConfig]:
        for name in models:
            if not re.match(MODEL_NAME_PATTERN, name):
                raise ValueError(f"model name {name!r} must match {MODEL_NAME_PATTERN}")
        return models


def digest_key(key: str) -> str:
    """The only form in which a key is ever stored: its SHA-256 hex digest."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def expand_env(value: Any, environ: Mapping[str, str], where: str = "") -> Any:
    """Expand `${VAR}` and `${VAR:-default}` in every string of a parsed YAML document."""
    if isinstance(value, str):

        def substitute(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in environ:
                return environ[name]
            if default is not None:
                return default
            raise ConfigError(f"{where or 'value'}: environment variable {name} is not set")

        return _ENV_REF.sub(substitute, value)
    if isinstance(value, dict):
        return {k: expand_env(v, environ, f"{where}.{k}".lstrip(".")) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, environ, f"{where}.{i}".lstrip(".")) for i, v in enumerate(value)]
    return value


def parse_config(text: str, source: str, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}:{where} not valid YAML") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        raw = expand_env(raw, os.environ if environ is None else environ)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    try:
        return GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_first_error(exc)}") from exc


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> GatewayConfig:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from exc
    return parse_config(text, str(path), environ)


def packaged_config(name: str) -> str:
    """The text of a config shipped with the package (config/*.yaml), e.g. demo.yaml."""
    return resources.files("gateway.configs").joinpath(name).read_text(encoding="utf-8")


def _first_error(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    return f"{where}: {message}{more}"
