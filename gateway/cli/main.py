"""Run the gateway, a demo or a simulated worker; mint API keys; export usage records.

`python -m gateway` is the same. Every command and option: see docs/cli.md. The commands that
do not serve are in their own modules: gateway/cli/keys.py, gateway/cli/usage.py."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from collections.abc import Sequence
from functools import partial

from gateway.cli.keys import keys_create
from gateway.cli.usage import usage_export
from gateway.edge.listen import ListenError, listen
from gateway.edge.logs import FORMATS
from gateway.edge.logs import setup as setup_logs
from gateway.runtime.settings import (
    MAX_RPM,
    MAX_TPM,
    MAX_WEIGHT,
    ConfigError,
    GatewayConfig,
    load_config,
)
from tiers.policy import Tier

log = logging.getLogger("gateway")
MAX_WORKERS = 256


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _serve_options(sub.add_parser("serve", help="run the gateway"))
    _demo_options(sub.add_parser("demo", help="gateway + two simulated workers + in-process store"))
    _sim_options(sub.add_parser("sim", help="a simulated vLLM-like GPU worker"))
    _keys_options(sub.add_parser("keys", help="API keys"))
    _usage_options(sub.add_parser("usage", help="usage records"))
    return parser


def _serve_options(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--config", required=True, help="YAML config file")
    serve.add_argument("--host", help="listen address (default: listen.host of the config)")
    serve.add_argument("--port", type=int, help="listen port (default: listen.port of the config)")
    serve.add_argument(
        "--workers",
        type=_worker_count,
        default=1,
        help="processes serving the port (SO_REUSEPORT; metrics and admission exact across "
        "them; default: %(default)s, this process alone)",
    )
    _log_options(serve)


def _endpoint_count(text: str) -> int:
    from gateway.sim.fleet import MAX_ENDPOINTS

    return _count_of(text, MAX_ENDPOINTS)


def _worker_count(text: str) -> int:
    return _count_of(text, MAX_WORKERS)


def _count_of(text: str, upto: int) -> int:
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 1 <= count <= upto:
        raise argparse.ArgumentTypeError(f"from 1 to {upto}")
    return count


def _demo_options(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--port", type=int, default=8000, help="gateway port (default: %(default)s)")
    demo.add_argument("--host", default="127.0.0.1", help="gateway address (default: %(default)s)")
    _log_options(demo)


def _sim_options(sim: argparse.ArgumentParser) -> None:
    sim.add_argument("--port", type=int, required=True, help="listen port (the first of them)")
    sim.add_argument(
        "--endpoints",
        type=_endpoint_count,
        default=1,
        help="workers in this process, one per port from --port up, each with its own "
        "slots and counters (default: %(default)s)",
    )
    sim.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    sim.add_argument(
        "--models", nargs="+", default=["sim-model"], help="model names served (default: sim-model)"
    )
    sim.add_argument(
        "--max-seqs", type=int, default=8, help="sequences run at once (default: %(default)s)"
    )
    sim.add_argument(
        "--ttft-ms", type=float, default=50.0, help="time to first token (default: %(default)s)"
    )
    sim.add_argument(
        "--itl-ms", type=float, default=10.0, help="time between tokens (default: %(default)s)"
    )
    sim.add_argument(
        "--tokens", type=int, default=16, help="natural answer length in tokens (default: 16)"
    )
    _sim_cache_options(sim)
    sim.add_argument(
        "--fault",
        choices=["hang", "error500", "die_mid_stream"],
        default=None,
        help="misbehave from the start: never answer, answer 500, or cut streams short",
    )


def _sim_cache_options(sim: argparse.ArgumentParser) -> None:
    sim.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="the KV cache in tokens, in whole blocks: a request runs while the running "
        "ones' prompts and answers fit (default: no cache limit, only --max-seqs)",
    )
    sim.add_argument(
        "--block-size", type=int, default=16, help="KV cache block in tokens (default: 16)"
    )


def _keys_options(command: argparse.ArgumentParser) -> None:
    keys = command.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    create = keys.add_parser("create", help="mint a key, print it once, store its digest")
    create.add_argument("--config", required=True, help="YAML config file (the store to use)")
    create.add_argument("--account", required=True, help="account the key's requests bill to")
    create.add_argument(
        "--max-concurrency",
        type=int,
        default=200,
        help="most requests of the key running at once (default: %(default)s)",
    )
    create.add_argument(
        "--weight",
        type=_weight,
        default=1.0,
        help="the account's share when several accounts wait in one tier (default: 1)",
    )
    create.add_argument(
        "--rpm",
        type=partial(_count_of, upto=MAX_RPM),
        help="the key's own limit of requests per minute, across all replicas (default: none)",
    )
    create.add_argument(
        "--tpm",
        type=partial(_count_of, upto=MAX_TPM),
        help="the key's own limit of tokens (prompt + completion) per minute (default: none)",
    )
    create.add_argument("--models", nargs="+", help="allow-list of models (default: all)")
    create.add_argument(
        "--tiers",
        nargs="+",
        choices=[t.value for t in Tier],
        help="allow-list of service tiers (default: all)",
    )


def _weight(text: str) -> float:
    """A key's weight: a positive number (fair share, docs/config.md)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= MAX_WEIGHT:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most {MAX_WEIGHT:g}")
    return value


def _usage_options(command: argparse.ArgumentParser) -> None:
    usage = command.add_subparsers(dest="usage_command", required=True, metavar="COMMAND")
    export = usage.add_parser("export", help="read the usage records")
    export.add_argument("--config", required=True, help="YAML config file (the store to read)")
    export.add_argument(
        "--since", help="only records from this time on (ISO 8601; UTC unless it has a zone)"
    )
    export.add_argument(
        "--format",
        choices=["jsonl", "csv"],
        default="jsonl",
        help="one JSON object per line, or CSV with a header (default: %(default)s)",
    )
    export.add_argument(
        "--by",
        help="sum instead, grouped by a comma-separated list of: account, tier, model, source",
    )


def _log_options(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--access-log",
        action="store_true",
        help="log one line per request (request id, model, tier, status, durations)",
    )
    command.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="text for people, json (one object per line) for log pipelines (default: %(default)s)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "demo":
            from gateway.cli.demo import main as demo_main

            setup_logs(args.log_format, access_log=args.access_log)
            return demo_main(args.port, args.host, access_log=args.access_log)
        if args.command == "sim":
            return _sim(args)
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
        )
        if args.command == "keys":
            return keys_create(args)
        return usage_export(args)
    except ConfigError as exc:
        print(f"gateway: config error: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before a server took the signals over
        return 130


def _serve(args: argparse.Namespace) -> int:
    from routing.store.probe import start_problem

    config = load_config(args.config)
    setup_logs(args.log_format, access_log=args.access_log, with_pid=args.workers > 1)
    # A store that will never serve (wrong password, ACL, TLS, not a master) stops the start.
    if (problem := start_problem(config.redis.url, config.redis.command_timeout_s)) is not None:
        print(f"gateway: {problem.text}", file=sys.stderr)
        return 2
    if args.workers > 1 and config.redis.url.startswith("memory://"):
        print(
            "gateway: --workers needs a shared store; memory:// lives in one process",
            file=sys.stderr,
        )
        return 2
    host = args.host or config.listen.host
    port = config.listen.port if args.port is None else args.port
    if args.workers == 1:
        sock = listen(host, port)
        log.info("serving %d models on %s:%d", len(config.models), host, sock.getsockname()[1])
        _serve_one(args, config, sock)
        return 0
    from gateway.edge.workers import Workers

    with listen(host, port, reuse_port=True) as holder:
        port = holder.getsockname()[1]
        log.info(
            "serving %d models on %s:%d with %d workers",
            len(config.models), host, port, args.workers,
        )  # fmt: skip
        serve_one = lambda: _serve_one(args, config, listen(host, port, reuse_port=True))  # noqa: E731
        return Workers(args.workers, serve_one).run(holder)


def _serve_one(args: argparse.Namespace, config: GatewayConfig, sock: socket.socket) -> None:
    """One gateway on `sock`, until a stop signal and its drain."""
    from gateway.app.front import build_app
    from gateway.edge.access import AccessLog
    from gateway.edge.server import serve
    from gateway.runtime.state import GatewayState

    state = GatewayState(config, config_path=args.config)

    def drain() -> None:
        state.begin_draining()
        log.info("stopping: draining requests in flight (up to %ss)", config.shutdown_grace_s)

    app = build_app(state)
    served = AccessLog(app) if args.access_log else app
    serve(served, sock, grace_s=config.shutdown_grace_s, on_stop=drain)


def _sim(args: argparse.Namespace) -> int:
    from gateway.edge.server import serve
    from gateway.sim import SimOptions, build_sim_app

    options = SimOptions(
        models=tuple(args.models),
        max_seqs=args.max_seqs,
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        tokens=args.tokens,
        fault=args.fault,
        kv_tokens=args.kv_tokens,
        block_size=args.block_size,
    )
    try:
        app = build_sim_app(options)  # checks the options
    except ValueError as exc:
        print(f"gateway sim: {exc}", file=sys.stderr)
        return 2
    setup_logs()
    if args.endpoints == 1:
        sock = listen(args.host, args.port)
        models = ", ".join(options.models)
        log.info("simulated worker for %s on %s:%d", models, args.host, args.port)
        serve(app, sock)
        return 0
    from gateway.sim.fleet import SimFleet

    ports = range(args.port, args.port + args.endpoints)
    if args.port < 1 or ports[-1] > 65535:
        raise ListenError(f"--endpoints {args.endpoints} needs ports {args.port} to {ports[-1]}")
    socks = [listen(args.host, port) for port in ports]
    log.info(
        "%d simulated workers for %s on %s:%d-%d",
        args.endpoints, ", ".join(options.models), args.host, ports[0], ports[-1],
    )  # fmt: skip
    serve(SimFleet(options, ports), socks)
    return 0
