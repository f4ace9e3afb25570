"""Endpoint health: active probes, passive ejection with back-off, the load penalty."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator

import aiohttp
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.runtime.settings import parse_config
from routing.background import BackgroundErrors
from routing.hop import scrape
from routing.hop.health import PROBES_PER_S, EndpointHealth, Health, HealthSettings
from routing.hop.scrape import Reading, gauge
from routing.registry import Registry

CONFIG = """
models:
  a:
    endpoints:
      - {url: "http://w1:8000", max_concurrency: 4}
      - {url: "http://w2:8000", max_concurrency: 4}
  b: {endpoints: [{url: "http://w2:8000", max_concurrency: 8, metrics: true}]}
"""
W1, W2 = "http://w1:8000", "http://w2:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(**settings: float) -> tuple[Health, list[set[str]], Clock]:
    registry = Registry(parse_config(CONFIG, "t.yaml").models)
    changes: list[set[str]] = []
    clock = Clock()
    health = Health(registry, HealthSettings(**settings), changes.append, clock=clock)
    return health, changes, clock


def test_endpoints_are_shared_between_models() -> None:
    health, _, _ = make()
    assert set(health.endpoints) == {W1, W2}
    assert health.endpoints[W2].size == 8
    assert health.endpoints[W2].scrape and not health.endpoints[W1].scrape


def test_failed_probes_take_it_out_and_a_good_one_brings_it_back() -> None:
    health, changes, _ = make(unhealthy_after=2)
    health.probed(W1, ok=False)
    assert health.is_up(W1) and changes == []
    health.probed(W1, ok=False)
    assert not health.is_up(W1) and changes == [{W1}]
    health.probed(W1, ok=True)
    assert health.is_up(W1) and changes == [{W1}, {W1}]


def test_unreachable_ejects_at_once_with_a_doubling_back_off() -> None:
    health, _, clock = make(ejection_s=5, max_ejection_s=120)
    health.unreachable(W1)
    assert not health.is_up(W1)
    health.probed(W1, ok=True)
    assert not health.is_up(W1)  # still inside its ejection
    clock.now += 5
    health.probed(W1, ok=True)
    assert health.is_up(W1)
    health.unreachable(W1)
    clock.now += 5
    health.probed(W1, ok=True)
    assert not health.is_up(W1)  # second ejection lasts 10 s
    clock.now += 5
    health.probed(W1, ok=True)
    assert health.is_up(W1)


def test_5xx_in_a_row_eject_and_a_success_resets_the_count() -> None:
    health, _, _ = make(passive_5xx=3)
    for status in (500, 502, 200, 503, 500):
        health.answered(W1, status)
    assert health.is_up(W1)
    health.answered(W1, 500)
    assert not health.is_up(W1)


def test_penalty_changes_are_reported() -> None:
    health, changes, _ = make()
    health.probed(W2, ok=True, reading=Reading(waiting=0.0, kv_usage=0.5))
    assert health.penalty(W2) == 0.5 and changes == [{W2}]
    health.probed(W2, ok=True, reading=Reading(waiting=0.0, kv_usage=0.51))
    assert changes == [{W2}]  # too small a change to rebuild anything
    health.probed(W1, ok=True, reading=Reading(waiting=4.0, kv_usage=1.0))
    assert health.penalty(W1) == 0.0  # not scraped for a penalty (no `metrics: true`)


def test_urls_it_does_not_know_are_ignored() -> None:
    # Requests still running on an endpoint a reload removed report on it.
    health, changes, _ = make(passive_5xx=1)
    gone = "http://gone:8000"
    health.answered(gone, 500)
    health.unreachable(gone)
    health.probed(gone, ok=False, reading=Reading(waiting=9.0))
    assert not health.is_up(gone) and health.penalty(gone) == 0.0
    assert changes == [] and gone not in health.endpoints


def test_gauge_sums_label_sets_and_knows_the_old_name() -> None:
    text = (
        "# HELP vllm:num_requests_waiting x\n"
        'vllm:num_requests_waiting{model_name="a"} 3.0\n'
        'vllm:num_requests_waiting{model_name="b"} 2.0\n'
        "vllm:gpu_cache_usage_perc 0.25\n"
    )
    assert gauge(text, ("vllm:num_requests_waiting",)) == 5.0
    assert gauge(text, ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")) == 0.25
    assert gauge(text, ("vllm:nothing",)) == 0.0


def test_gauge_skips_malformed_lines() -> None:
    text = "vllm:num_requests_waiting{\nvllm:num_requests_waiting x\nvllm:num_requests_waiting 2\n"
    assert gauge(text, ("vllm:num_requests_waiting",)) == 2.0


@pytest.fixture
async def worker() -> AsyncIterator[tuple[str, dict[str, object]]]:
    """A real HTTP worker on loopback whose /health and /metrics the test controls."""
    control: dict[str, object] = {"health": 200, "waiting": 8.0}

    async def health_route(_: object) -> PlainTextResponse:
        status = int(str(control["health"]))
        # A redirect points at a page that answers 200: followed, it would pass.
        moved = {"location": "/metrics"} if 300 <= status < 400 else None
        return PlainTextResponse("", status_code=status, headers=moved)

    async def metrics_route(_: object) -> PlainTextResponse:
        waiting = control["waiting"]
        return PlainTextResponse(
            f"vllm:num_requests_waiting {waiting}\nvllm:kv_cache_usage_perc 0.5\n"
        )

    app = Starlette(routes=[Route("/health", health_route), Route("/metrics", metrics_route)])
    # A socket bound here: connections wait in its backlog until the server accepts them.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    yield f"http://127.0.0.1:{port}", control
    server.should_exit = True
    await task
    sock.close()


async def test_probes_against_a_real_worker(worker: tuple[str, dict[str, object]]) -> None:
    url, control = worker
    config = parse_config(
        f'models: {{m: {{endpoints: [{{url: "{url}", max_concurrency: 4, metrics: true}}]}}}}',
        "t.yaml",
    )
    changes: list[set[str]] = []
    health = Health(Registry(config.models), HealthSettings(unhealthy_after=1), changes.append)
    await health.start()
    try:
        await health.probe_all()
        assert health.is_up(url)
        assert health.penalty(url) == pytest.approx(2.0 + 0.5)  # waiting 8 / size 4, capped at 2
        control["health"] = 503
        await health.probe_all()
        assert not health.is_up(url)
    finally:
        await health.close()


async def test_an_unexpected_error_in_a_round_is_counted_and_probing_goes_on(
    worker: tuple[str, dict[str, object]],
) -> None:
    url, _ = worker
    config = parse_config(
        f'models: {{m: {{endpoints: [{{url: "{url}", max_concurrency: 4}}]}}}}', "t.yaml"
    )
    errors = BackgroundErrors()
    settings = HealthSettings(interval_s=0.01)
    health = Health(Registry(config.models), settings, lambda _: None, errors=errors)
    rounds: list[bool] = []
    probed_again = asyncio.Event()
    real_probed = health.probed

    def probed(url: str, ok: bool, reading: Reading | None = None) -> None:
        rounds.append(ok)
        if len(rounds) == 1:
            raise RuntimeError("an odd answer")
        real_probed(url, ok, reading)
        probed_again.set()

    health.probed = probed  # type: ignore[method-assign]
    await health.start()
    try:
        await asyncio.wait_for(probed_again.wait(), 10)
    finally:
        await health.close()
    assert errors.counts["health"] == 1
    assert health.is_up(url)


async def test_probes_over_a_lent_session_which_close_leaves_open(
    worker: tuple[str, dict[str, object]],
) -> None:
    """The gateway lends the upstream hop's session; a redirect is an answer, not followed."""
    url, control = worker
    config = parse_config(
        f'models: {{m: {{endpoints: [{{url: "{url}", max_concurrency: 4}}]}}}}', "t.yaml"
    )
    health = Health(Registry(config.models), HealthSettings(unhealthy_after=1), lambda _: None)
    async with aiohttp.ClientSession() as session:
        await health.start(session)
        try:
            await health.probe_all()
            assert health.is_up(url)
            control["health"] = 302
            await health.probe_all()
            assert not health.is_up(url)
        finally:
            await health.close()
        assert not session.closed


async def test_a_rounds_changes_are_told_in_one_call() -> None:
    """One call to `on_change` per probe round, naming every endpoint that changed."""
    health, changes, _ = make(unhealthy_after=1)

    async def probe(h: EndpointHealth) -> tuple[bool, Reading | None]:
        return h.url == W2, Reading(waiting=16.0, kv_usage=0.0) if h.url == W2 else None

    health._probe = probe  # type: ignore[method-assign,assignment]
    await health.probe_all()
    assert changes == [{W1, W2}]  # w1 out of rotation, w2's penalty up: one call
    assert health.penalty(W2) == 2.0
    await health.probe_all()
    assert changes == [{W1, W2}]  # nothing changed: nothing told


async def test_a_large_fleet_is_probed_in_turn_within_a_rounds_budget() -> None:
    """120 endpoints, a round of 50 probes (PROBES_PER_S at the default interval): those out
    of rotation every round, the rest in turn, each within three rounds; a good answer to a
    real request counts as a good probe."""
    urls = [f"http://w{i}:8000" for i in range(120)]
    endpoints = "".join(f'      - {{url: "{u}", max_concurrency: 1}}\n' for u in urls)
    config = parse_config(f"models:\n  a:\n    endpoints:\n{endpoints}", "t.yaml")
    health = Health(Registry(config.models), HealthSettings(unhealthy_after=1), lambda _: None)
    budget = PROBES_PER_S * health.settings.interval_s
    assert budget == 50
    rounds: list[list[str]] = []

    async def probe(h: EndpointHealth) -> tuple[bool, Reading | None]:
        rounds[-1].append(h.url)
        return h.url != urls[7], None

    health._probe = probe  # type: ignore[method-assign,assignment]
    for _ in range(4):
        rounds.append([])
        await health.probe_all()
    assert all(len(r) == budget for r in rounds)
    assert not health.is_up(urls[7])
    assert all(urls[7] in r for r in rounds[1:])  # out of rotation: every round
    assert set(rounds[0]) | set(rounds[1]) | set(rounds[2]) == set(urls)  # all in 3 rounds
    health.endpoints[urls[9]].failed_probes = 1  # (a failed probe, not out yet)
    health.answered(urls[9], 200)
    assert health.endpoints[urls[9]].failed_probes == 0


@pytest.fixture
async def trickler() -> AsyncIterator[str]:
    """A hostile worker: its answers' headers come at once, then a byte now and then,
    never the end (each gap shorter than the probe timeout)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000000\r\n\r\n")
        try:
            while True:
                writer.write(b"#")
                await writer.drain()
                await asyncio.sleep(0.05)
        except (ConnectionError, asyncio.CancelledError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()


async def test_a_probe_slower_than_the_timeout_fails_and_holds_up_no_round(
    worker: tuple[str, dict[str, object]], trickler: str
) -> None:
    """A worker that answers a byte at a time fails its probe after `timeout_s`, and the
    round goes on: the other endpoints' health is still judged."""
    url, control = worker
    endpoints = f'[{{url: "{url}", max_concurrency: 4}}, {{url: "{trickler}", max_concurrency: 4}}]'
    config = parse_config(f"models: {{m: {{endpoints: {endpoints}}}}}", "t.yaml")
    settings = HealthSettings(unhealthy_after=1, timeout_s=0.3)
    health = Health(Registry(config.models), settings, lambda _: None)
    await health.start()
    try:
        control["health"] = 503
        # Bounded only so that the test fails instead of hanging.
        await asyncio.wait_for(health.probe_all(), 30)
        assert not health.is_up(trickler)
        assert not health.is_up(url)
    finally:
        await health.close()


async def test_a_workers_metrics_are_read_off_the_event_loop(
    worker: tuple[str, dict[str, object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hostile /metrics (8 MiB of one label set, escapes) takes the parser most of a
    second: it runs in a thread, so the replica's requests go on meanwhile."""
    url, _ = worker
    config = parse_config(
        f'models: {{m: {{endpoints: [{{url: "{url}", max_concurrency: 4, metrics: true}}]}}}}',
        "t.yaml",
    )
    threads: list[threading.Thread] = []
    real_read = scrape.read

    def read(text: str, *, load: bool, cache: bool, props: str | None = None) -> Reading:
        threads.append(threading.current_thread())
        return real_read(text, load=load, cache=cache, props=props)

    monkeypatch.setattr(scrape, "read", read)
    health = Health(Registry(config.models), HealthSettings(), lambda _: None)
    await health.start()
    try:
        await health.probe_all()
    finally:
        await health.close()
    assert threads and threading.main_thread() not in threads
    assert health.penalty(url) == pytest.approx(2.0 + 0.5)


@pytest.fixture
async def workers() -> AsyncIterator[tuple[str, dict[str, float]]]:
    """Real HTTP workers on loopback, one per path prefix (`<url>/w1`, `<url>/w2`...): each
    answers /health and /metrics, after `delay` seconds each (a slow worker) when set."""
    control: dict[str, float] = {"delay": 0.0}

    async def route(request: Request) -> PlainTextResponse:
        if control["delay"]:
            await asyncio.sleep(control["delay"])
        if request.url.path.endswith("/metrics"):
            return PlainTextResponse("vllm:num_requests_waiting 4\nvllm:kv_cache_usage_perc 0\n")
        return PlainTextResponse("")

    app = Starlette(routes=[Route("/{rest:path}", route)])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", control
    server.should_exit = True
    await task
    sock.close()


def scraped(urls: list[str], settings: HealthSettings) -> Health:
    endpoints = ", ".join(f'{{url: "{u}", max_concurrency: 4, metrics: true}}' for u in urls)
    config = parse_config(f"models: {{m: {{endpoints: [{endpoints}]}}}}", "t.yaml")
    return Health(Registry(config.models), settings, lambda _: None)


async def test_metrics_are_parsed_one_at_a_time_on_a_thread_of_their_own(
    workers: tuple[str, dict[str, float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round of many endpoints queues its parses on one thread of Health's own, made at
    the first parse and ended by close: not on the loop's default executor, where a
    thousand parses would wait beside everything else and parser threads contend."""
    base, _ = workers
    urls = [f"{base}/w{i}" for i in range(6)]
    threads: list[threading.Thread] = []
    lock, running, most = threading.Lock(), [0], [0]
    real_read = scrape.read

    def read(text: str, *, load: bool, cache: bool, props: str | None = None) -> Reading:
        with lock:
            threads.append(threading.current_thread())
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            return real_read(text, load=load, cache=cache, props=props)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(scrape, "read", read)
    health = scraped(urls, HealthSettings())
    before = set(threading.enumerate())
    await health.start()
    try:
        assert set(threading.enumerate()) == before  # made at the first parse, not before
        await health.probe_all()
        await health.probe_all()
    finally:
        await health.close()
    assert len(threads) >= 12 and most == [1]  # (the loop's own first round too, maybe)
    assert len(set(threads)) == 1 and threads[0].name.startswith("gateway-health-parse")
    threads[0].join(10)  # close shut it down (bounded, so that the test fails, not hangs)
    assert not threads[0].is_alive()
    assert all(health.penalty(u) == pytest.approx(1.0) for u in urls)  # waiting 4 / size 4


async def test_the_whole_probe_is_bounded_by_the_timeout(
    workers: tuple[str, dict[str, float]],
) -> None:
    """docs/config.md: "a probe slower than this failed". A worker that answers /health and
    then /metrics each within `timeout_s`, but not both, fails its probe: a round never
    takes longer than the timeout, whatever an endpoint reads."""
    base, control = workers
    url = f"{base}/w"
    health = scraped([url], HealthSettings(unhealthy_after=1, timeout_s=0.5))
    await health.start()
    try:
        await health.probe_all()
        assert health.is_up(url)
        control["delay"] = 0.3  # each answer 0.6 x the timeout: the probe 1.2 x
        await asyncio.wait_for(health.probe_all(), 30)
        assert not health.is_up(url)
    finally:
        await health.close()
