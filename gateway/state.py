"""Everything a running gateway holds, built from config, started in the lifespan."""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway.auth import KeyStore
from gateway.metrics import Metrics
from gateway.settings import GatewayConfig
from routing.admission import Admission
from routing.endpoints import Pools
from routing.keeper import Keeper
from routing.registry import Registry
from routing.store import connect, script_store, subscriber
from routing.upstream import Upstream


class GatewayState:
    """Built once per process; `start` opens connections, `close` releases them."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        redis: aioredis.Redis | None = None,
        upstream: Upstream | None = None,
        sweep_interval_s: float = 1.0,
    ) -> None:
        self.config = config
        self.registry = Registry(config.models)
        self.pools = Pools(self.registry)
        self.redis = redis if redis is not None else connect(config.redis.url)
        capacity = sum(m.capacity for m in self.registry)
        self.upstream = upstream or Upstream(config.upstream, max_connections=capacity + 64)
        self.keys = KeyStore(config.keys, self.redis)
        self.admission = Admission(
            self.redis,
            self.registry,
            config.tiers,
            lease_ttl_s=config.redis.lease_ttl_s,
            on_outage=config.redis.on_outage,
            store=script_store(config.redis.url, self.redis),
        )
        interval = min(sweep_interval_s, config.redis.lease_ttl_s / 4)
        self.keeper = Keeper(self.admission, subscriber(config.redis.url, self.redis), interval)
        self.metrics = Metrics()
        for model in self.registry:
            self.metrics.capacity.labels(model.name).set(model.capacity)
            for endpoint in model.config.endpoints:
                self.metrics.endpoint_up.labels(model.name, endpoint.base_url).set(1)

    async def start(self) -> None:
        await self.upstream.start()
        await self.admission.start()
        await self.keeper.start()

    async def close(self) -> None:
        await self.keeper.close()
        await self.admission.close()
        if self.admission.store is not self.redis:
            await self.admission.store.aclose()
        await self.upstream.close()
        if self.keeper.pubsub_redis is not self.redis:
            await self.keeper.pubsub_redis.aclose()
        await self.redis.aclose()

    def render_metrics(self) -> bytes:
        """Prometheus text; the fleet-wide gauges come from the keeper's last sweep."""
        m = self.metrics
        for model, state in self.keeper.states.items():
            m.inflight.labels(model).set(state.inflight)
            for tier, depth in state.queued.items():
                m.queue_depth.labels(model, tier.value).set(depth)
        return m.render()
