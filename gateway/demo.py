"""`gateway demo`: the gateway, two simulated GPU workers and an in-process store, one command."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

from gateway.app import build_app
from gateway.auth import create_key
from gateway.server import serve_together, server_config
from gateway.settings import packaged_config, parse_config
from gateway.sim import SimOptions, build_sim_app
from gateway.state import GatewayState
from routing.store import connect

DEMO_MODELS = ("demo/llama-3-8b", "demo/mistral-7b")
DEMO_SIM = {"max_seqs": 8, "ttft_ms": 60.0, "itl_ms": 25.0, "tokens": 24}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def run_demo(port: int, host: str = "127.0.0.1") -> None:
    worker_ports = (_free_port(), _free_port())
    environ = {
        **os.environ,
        "GATEWAY_DEMO_WORKER_A": f"http://127.0.0.1:{worker_ports[0]}",
        "GATEWAY_DEMO_WORKER_B": f"http://127.0.0.1:{worker_ports[1]}",
    }
    config = parse_config(packaged_config("demo.yaml"), "demo.yaml", environ)
    redis = connect("memory://", command_timeout_s=config.redis.command_timeout_s)
    key = await create_key(redis, "demo", max_concurrency=50)
    state = GatewayState(config, redis=redis)
    sim = SimOptions(models=DEMO_MODELS, **DEMO_SIM)  # type: ignore[arg-type]
    configs = [server_config(build_sim_app(sim), "127.0.0.1", p) for p in worker_ports]
    configs.append(server_config(build_app(state), host, port))

    def banner() -> None:
        base = f"http://{host}:{port}"
        body = (
            '{"model": "demo/llama-3-8b", "service_tier": "priority", '
            '"messages": [{"role": "user", "content": "Hello!"}]}'
        )
        print(
            f"gateway demo ready on {base}  (2 simulated workers on ports "
            f"{worker_ports[0]} and {worker_ports[1]}, in-process store)\n"
            f"demo key: {key}\n"
            f"models: {', '.join(DEMO_MODELS)}\n\n"
            f"try:\n"
            f"  curl -s {base}/v1/chat/completions -H 'Authorization: Bearer {key}' "
            f"-H 'Content-Type: application/json' -d '{body}'\n\n"
            f"or with the openai SDK: OpenAI(base_url='{base}/v1', api_key='{key}')\n"
            f"Ctrl-C stops everything.",
            flush=True,
        )

    await serve_together(configs, on_ready=banner)


def main(port: int, host: str) -> int:
    try:
        asyncio.run(run_demo(port, host))
    except OSError as exc:
        print(f"gateway demo: {exc}", file=sys.stderr)
        return 1
    return 0
