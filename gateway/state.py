"""Everything a running gateway holds, built from config, started in the lifespan."""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway.auth import KeyStore
from gateway.metrics import Metrics
from gateway.settings import GatewayConfig
from routing.endpoints import Pools
from routing.registry import Registry
from routing.store import connect
from routing.upstream import Upstream


class GatewayState:
    """Built once per process; `start` opens connections, `close` releases them."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        redis: aioredis.Redis | None = None,
        upstream: Upstream | None = None,
    ) -> None:
        self.config = config
        self.registry = Registry(config.models)
        self.pools = Pools(self.registry)
        self.redis = redis if redis is not None else connect(config.redis.url)
        capacity = sum(m.capacity for m in self.registry)
        self.upstream = upstream or Upstream(config.upstream, max_connections=capacity + 64)
        self.keys = KeyStore(config.keys, self.redis)
        self.metrics = Metrics()
        for model in self.registry:
            self.metrics.capacity.labels(model.name).set(model.capacity)
            for endpoint in model.config.endpoints:
                self.metrics.endpoint_up.labels(model.name, endpoint.base_url).set(1)

    async def start(self) -> None:
        await self.upstream.start()

    async def close(self) -> None:
        await self.upstream.close()
        await self.redis.aclose()
