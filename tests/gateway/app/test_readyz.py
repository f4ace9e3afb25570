"""/readyz (docs/api.md): 503 with the reason while Redis does not answer (a stall is a prompt
503, never a hang), while a model has no healthy endpoint, or while draining."""

from __future__ import annotations

import asyncio

import httpx
import redis

from gateway.app.front import build_app
from gateway.runtime.settings import parse_config
from gateway.runtime.state import GatewayState
from tests.redis_server import RedisServer

CONFIG = """
redis: {{url: "{url}", command_timeout_s: 0.3}}
models:
  m1:
    endpoints: [{{url: "http://127.0.0.1:9", max_concurrency: 2}}]
  m2:
    endpoints:
      - {{url: "http://127.0.0.1:10", max_concurrency: 2}}
      - {{url: "http://127.0.0.1:11", max_concurrency: 2}}
"""


async def test_readyz_is_503_while_redis_is_stalled(private_redis: RedisServer) -> None:
    state = GatewayState(parse_config(CONFIG.format(url=private_redis.url), "stall.yaml"))
    await asyncio.wait_for(state.start(), 10)
    transport = httpx.ASGITransport(app=build_app(state))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:

            async def readyz() -> httpx.Response:
                return await asyncio.wait_for(http.get("/readyz"), 5)

            assert (await readyz()).status_code == 200
            private_redis.pause()
            try:
                stalled = await readyz()
            finally:
                private_redis.resume()
            assert stalled.status_code == 503
            assert stalled.json()["reason"] == "redis: no answer within 0.3 s"
            assert (await readyz()).status_code == 200
    finally:
        await asyncio.wait_for(state.close(), 10)


async def test_readyz_names_a_model_without_a_healthy_endpoint_and_draining(
    private_redis: RedisServer,
) -> None:
    state = GatewayState(parse_config(CONFIG.format(url=private_redis.url), "ready.yaml"))
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        assert (await http.get("/readyz")).status_code == 200
        state.health.unreachable("http://127.0.0.1:10")  # m2 keeps one endpoint
        assert (await http.get("/readyz")).status_code == 200
        state.health.unreachable("http://127.0.0.1:9")  # m1 has none left
        down = await http.get("/readyz")
        assert down.status_code == 503
        assert down.json() == {"status": "unavailable", "reason": "no healthy endpoint for m1"}
        assert (await http.get("/healthz")).status_code == 200  # alive all the same
        state.draining = True
        assert (await http.get("/readyz")).json()["reason"] == "shutting down"
    await asyncio.wait_for(state.close(), 10)


async def test_readyz_asks_whether_scripts_may_run_once_a_minute_not_every_probe(
    private_redis: RedisServer,
) -> None:
    """The script probe answers NOSCRIPT, which Redis counts as a failed call: every probe
    of every replica would show as a stream of errors in Redis's own stats."""
    state = GatewayState(parse_config(CONFIG.format(url=private_redis.url), "probe.yaml"))
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        for _ in range(5):
            assert (await http.get("/readyz")).status_code == 200
    await state.redis.aclose()
    with redis.Redis(port=private_redis.port) as admin:
        stats = admin.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 1
    assert stats["cmdstat_role"]["calls"] == 5
