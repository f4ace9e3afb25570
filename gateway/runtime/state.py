"""Everything a running gateway holds, built from config, started in the lifespan."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import redis.asyncio as aioredis

from gateway.metrics import Metrics
from gateway.ratelimits import Headers, quota_headers
from gateway.runtime.auth import Account, KeyStore
from gateway.runtime.reload import ConfigWatcher
from gateway.runtime.settings import GatewayConfig
from routing.admission.admit import Admission
from routing.admission.keeper import Keeper
from routing.admission.slots import EndpointSpec
from routing.background import BackgroundErrors
from routing.hop.client import HopClient
from routing.hop.endpoints import Pools
from routing.hop.health import Health
from routing.ledger.spool import UsageSpool
from routing.registry import Registry
from routing.store.causes import StoreErrors
from routing.store.connect import call_timeout, connect, script_store, subscriber
from routing.store.probe import probe

# /readyz asks whether scripts may run at most this often while they may (a NOSCRIPT
# answer counts as a failed call in Redis's own stats); every probe while they may not.
SCRIPT_CHECK_S = 60.0

log = logging.getLogger("gateway")


class GatewayState:
    """Built once per process; `start` opens connections, `close` releases them."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        redis: aioredis.Redis | None = None,
        upstream: HopClient | None = None,
        sweep_interval_s: float = 1.0,
        config_path: str | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.registry = Registry(config.models)
        self.pools = Pools(self.registry)
        timeout_s = config.redis.command_timeout_s
        self._call_timeout_s = call_timeout(config.redis.url, timeout_s)
        self._scripts_ok_at = -math.inf  # when /readyz last saw this user may run scripts
        self.redis = (
            redis if redis is not None else connect(config.redis.url, command_timeout_s=timeout_s)
        )
        capacity = sum(m.capacity for m in self.registry)
        self.upstream = upstream or HopClient(config.upstream, max_connections=capacity + 64)
        # Store errors of every part, logged by cause once a minute; /readyz reads it too.
        self.store_errors = StoreErrors()
        self.keys = KeyStore(
            config.keys, self.redis, accounts=config.accounts, store_errors=self.store_errors
        )
        self.background_errors = BackgroundErrors(self.store_errors)
        self.admission, self.keeper = self._admission(
            min(sweep_interval_s, config.redis.lease_ttl_s / 4)
        )
        self.health = self._new_health()
        self.metrics = Metrics(self.background_errors.counts)
        self._health_changed({url for url in self.health.endpoints})
        # Set on SIGTERM: /readyz says 503 and new requests are refused while those in
        # flight finish.
        self.draining = False
        self._watcher: ConfigWatcher | None = None
        self._publisher: asyncio.Task[None] | None = None
        # The (model, endpoint) pairs `gateway_tokens_reserved` has a series for.
        self._reserved_shown: set[tuple[str, str]] = set()

    def _admission(self, sweep_interval_s: float) -> tuple[Admission, Keeper]:
        redis = self.config.redis
        admission = Admission(
            script_store(redis.url, self.redis, redis.command_timeout_s),
            self.registry,
            self.config.tiers,
            lease_ttl_s=redis.lease_ttl_s,
            on_outage=redis.on_outage,
            spool=UsageSpool(self.config.usage, redis.url),
            sweep_interval_s=sweep_interval_s,
            command_timeout_s=redis.command_timeout_s,
            store_errors=self.store_errors,
        )
        keeper = Keeper(
            admission,
            subscriber(redis.url, self.redis),
            sweep_interval_s,
            self.background_errors,
            # A round never waits on a stall: its calls fail at the command timeout
            # (memory:// has none: it cannot stall apart from this process).
            round_timeout_s=2 * self._call_timeout_s + 1 if self._call_timeout_s else None,
        )
        return admission, keeper

    def _new_health(self) -> Health:
        return Health(
            self.registry, self.config.health, self._health_changed, errors=self.background_errors
        )

    def _health_changed(self, urls: set[str]) -> None:
        """Endpoints went in or out of rotation, or their penalty or token budget changed:
        capacities, scripts and gauges follow (Redis's index is written what changed)."""
        health = self.health
        for model in self.registry:
            if not any(e.base_url in urls for e in model.config.endpoints):
                continue
            name = model.name
            healthy: list[EndpointSpec] = [
                (
                    url,
                    e.max_concurrency,
                    health.penalty(url),
                    health.budget(name, url),
                    health.whole_budget(name, url),
                )
                for e in model.config.endpoints
                if health.is_up(url := e.base_url)
            ]
            self.admission.set_endpoints(name, healthy)
            self.metrics.capacity.labels(name).set(self.admission.capacity(name))
            for e in model.config.endpoints:
                up = 1 if health.is_up(e.base_url) else 0
                self.metrics.endpoint_up.labels(name, e.base_url).set(up)
                if e.max_tokens_in_flight is not None:  # NaN: `auto`, not read yet
                    show_budget(self.metrics, name, e.base_url, health.budget(name, e.base_url))

    def begin_draining(self) -> None:
        """SIGTERM (called from the signal handler): /readyz says 503 and new requests are
        refused; requests waiting in a queue are answered 503 at once, so their callers go
        to another replica; requests running get the grace period."""
        self.draining = True
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(self.admission.waiting.turn_away, "The gateway is shutting down.")

    def unready(self) -> str | None:
        """Why this replica should not get traffic, or None."""
        if self.draining:
            return "shutting down"
        down = [m.name for m in self.registry if self.admission.capacity(m.name) == 0]
        if down:
            return "no healthy endpoint for " + ", ".join(down[:10])
        return None

    async def quota_headers(self, account: Account | None) -> Headers:
        """A rate-limited key's x-ratelimit-* headers for an answer that never reached
        admission (a 404, 413, 422, the model list): the buckets as Redis says now, charging
        nothing; none for a key without limits."""
        if account is None or account.rates is None:
            return ()
        return quota_headers(await self.admission.rates.peek(account.rates))

    async def store_unready(self) -> str | None:
        """Why the store cannot serve this replica now (docs/api.md, /readyz), or None: the live
        probe's cause, else a misconfiguration that refused a request lately."""
        now = time.monotonic()
        scripts = now - self._scripts_ok_at >= SCRIPT_CHECK_S
        cause = await probe(self.redis, self._call_timeout_s, scripts=scripts)
        if cause is not None:
            self.store_errors.note(cause, "readyz")
        else:
            self._scripts_ok_at = now if scripts else self._scripts_ok_at
            cause = self.store_errors.refusal()
        return cause.public if cause is not None else None

    async def start(self) -> None:
        await self.upstream.start()
        await self.admission.start()
        await self.keeper.start()
        await self.health.start()
        if self.config_path is not None:
            self._watcher = ConfigWatcher(self.config_path, self.apply, self.background_errors)
            await self._watcher.start()
        if self.metrics.shared_dir is not None:
            self._publisher = asyncio.get_running_loop().create_task(self._publish_metrics())

    async def apply(self, config: GatewayConfig) -> None:
        """A changed config, applied without a restart and without failing requests in
        flight: models, endpoints, capacities, tiers, health settings, keys, accounts' limits
        and `redis.on_outage` (a policy, no connection). Settings of connections made at start
        (listen, the rest of redis, upstream, usage spool) need a restart; a change to them
        is logged and the running values stay."""
        config = self._keep_restart_only(config)
        old_names = set(self.registry.names())
        old_slots = set(self.admission.slots)
        old_budgets = self._budgeted()
        self.config = config
        self.registry = Registry(config.models)
        # Endpoints that leave stay known while leases still hold them.
        self.pools.apply(
            self.registry, [(h.model, h.endpoint) for h in self.admission.held.values()]
        )
        self.keys = KeyStore(
            config.keys, self.redis, accounts=config.accounts, store_errors=self.store_errors
        )
        self.admission.apply(self.registry, config.tiers, config.redis.on_outage)
        previous = self.health
        self.health = self._new_health()
        self.health.adopt(previous)
        await previous.close()
        await self.health.start()
        for gone in old_names - set(self.registry.names()):
            self.admission.set_endpoints(gone, [])
            self.metrics.capacity.labels(gone).set(0)
        for model, url in old_budgets - self._budgeted():  # no budget now: none shown
            self.metrics.token_budget.labels(model, url).set(math.nan)
        self._health_changed(set(self.health.endpoints))
        if set(self.admission.slots) != old_slots:  # new models or partitions
            self.keeper.resubscribe()
        log.info("config reloaded: %d models", len(config.models))

    def _refresh_reserved(self) -> None:
        """`gateway_tokens_reserved` as the keeper last read it. An endpoint it no longer
        reads (gone from the config, nothing reserved there) loses its series; shared
        between workers, where prometheus-client cannot remove one, it says NaN."""
        gauge, reserved = self.metrics.tokens_reserved, self.keeper.reserved
        for model, url in self._reserved_shown - reserved.keys():
            if self.metrics.shared_dir is None:
                gauge.remove(model, url)
            else:
                gauge.labels(model, url).set(math.nan)
        for (model, url), tokens in reserved.items():
            gauge.labels(model, url).set(tokens)
        self._reserved_shown = set(reserved)

    def _budgeted(self) -> set[tuple[str, str]]:
        """The (model, endpoint) pairs the config gives a token budget."""
        return {
            (m.name, e.base_url)
            for m in self.registry
            for e in m.config.endpoints
            if e.max_tokens_in_flight is not None
        }

    def _keep_restart_only(self, config: GatewayConfig) -> GatewayConfig:
        """`config` with the running values of what changes only on restart (logged)."""
        redis = self.config.redis.model_copy(update={"on_outage": config.redis.on_outage})
        kept = {"listen": self.config.listen, "redis": redis}
        kept |= {"upstream": self.config.upstream, "usage": self.config.usage}
        changed = sorted(k for k, running in kept.items() if getattr(config, k) != running)
        if changed:
            log.warning("config reload: %s change only on restart", ", ".join(changed))
        return config.model_copy(update=kept)

    async def close(self) -> None:
        if self._watcher is not None:
            await self._watcher.close()
        if self._publisher is not None:
            self._publisher.cancel()
            await asyncio.gather(self._publisher, return_exceptions=True)
            self._refresh_metrics()  # the last counts of a worker that stops stay counted
        await self.health.close()
        await self.keeper.close()
        await self.admission.close()
        if self.admission.ledger.spool is not None:
            self.admission.ledger.spool.close()
        await self.admission.store.aclose()
        await self.upstream.close()
        if self.keeper.pubsub_redis is not self.redis:
            await self.keeper.pubsub_redis.aclose()
        await self.redis.aclose()

    def render_metrics(self) -> bytes:
        """Prometheus text; the fleet-wide gauges come from the keeper's last sweep."""
        self._refresh_metrics()
        return self.metrics.render()

    async def _publish_metrics(self) -> None:
        """`serve --workers N`: what this worker alone knows (its spool, its background
        errors) is written for the others' scrapes every second."""
        while True:
            await asyncio.sleep(1.0)
            try:
                self._refresh_metrics()
            except Exception:  # never expected (local reads); the next round tries again
                log.exception("metrics refresh failed")

    def _refresh_metrics(self) -> None:
        """Set the metrics read at scrape time, and publish them when shared."""
        m = self.metrics
        spool = self.admission.ledger.spool
        if spool is not None:
            m.usage_spooled.set(spool.size_bytes())
            m.usage_lost = spool.lost
            m.usage_bad_lines = spool.bad_lines
            if spool.stream is not None:
                m.usage_stream_length.set(spool.stream.length)
                m.usage_stream_oldest_age.set(spool.stream.oldest_age_s)
        m.replicas.set(self.admission.local.replicas)
        self._refresh_reserved()
        for model, state in self.keeper.states.items():
            m.inflight.labels(model).set(state.inflight)
            for tier, depth in state.queued.items():
                m.queue_depth.labels(model, tier.value).set(depth)
        m.publish()


# In shared metrics: the time a value not known yet is stamped with (1970, later than the
# 0 that a series never set has, earlier than anything set).
UNKNOWN_AT = 1.0


def show_budget(metrics: Metrics, model: str, url: str, budget: int | None) -> None:
    """`gateway_token_budget` of a model's endpoint; NaN while not read yet (None). Shared
    between workers (the value the latest set wins), a NaN not read yet is written as set
    at UNKNOWN_AT, older than any value: a worker just started again does not hide, until
    its first probe, the budget the others read; it shows only while none knows one."""
    child = metrics.token_budget.labels(model, url)
    if budget is not None:
        child.set(budget)
    elif metrics.shared_dir is None:
        child.set(math.nan)
    else:  # Gauge.set stamps the time now; its value class takes an older stamp
        child._value.set(math.nan, timestamp=UNKNOWN_AT)
