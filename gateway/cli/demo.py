"""`gateway demo`: the gateway, two simulated GPU workers and an in-process store, one command."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

from gateway.app.front import build_app
from gateway.edge.access import AccessLog
from gateway.edge.listen import listen
from gateway.edge.server import StartupFailed, serve_together, server_config
from gateway.runtime.auth import create_key
from gateway.runtime.settings import packaged_config, parse_config
from gateway.runtime.state import GatewayState
from gateway.sim import SimOptions, build_sim_app
from routing.store.connect import connect

DEMO_MODELS = ("demo/llama-3-8b", "demo/mistral-7b")
DEMO_SIM = {"max_seqs": 8, "ttft_ms": 60.0, "itl_ms": 25.0, "tokens": 24}


async def run_demo(
    gateway: socket.socket, workers: tuple[socket.socket, socket.socket], access_log: bool
) -> None:
    """Serve on the bound sockets until SIGINT or SIGTERM."""
    host, port = gateway.getsockname()[:2]
    worker_ports = [w.getsockname()[1] for w in workers]
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
    app = build_app(state)
    apps = [(server_config(build_sim_app(sim)), w) for w in workers]
    apps.append((server_config(AccessLog(app) if access_log else app), gateway))

    def banner() -> None:
        base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
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

    await serve_together(apps, on_ready=banner)


def main(port: int, host: str, *, access_log: bool = False) -> int:
    """The gateway's port first: if it is taken (ListenError), nothing else has started."""
    gateway = listen(host, port)
    # Bound here, not picked and bound later: no other process can take them in between.
    workers = (listen("127.0.0.1", 0), listen("127.0.0.1", 0))
    try:
        asyncio.run(run_demo(gateway, workers, access_log))
    except StartupFailed as exc:
        print(f"gateway demo: {exc}", file=sys.stderr)
        return 1
    finally:
        for sock in (gateway, *workers):
            sock.close()
    return 0
