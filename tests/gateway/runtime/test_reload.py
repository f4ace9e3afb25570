"""The config watcher: a file that does not load is refused once; an apply that fails is
counted and tried again on the next round; the watcher itself never stops. And what a
reload changes: `redis.on_outage` at once, the rest of `redis` only on restart."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import pytest

from gateway.runtime.reload import ConfigWatcher
from gateway.runtime.settings import GatewayConfig, parse_config
from gateway.runtime.state import GatewayState
from routing.admission.plan import plan_candidates
from routing.background import BackgroundErrors
from routing.errors import Limited, Unavailable


def config_text(size: int) -> str:
    return f'models: {{m: {{endpoints: [{{url: "http://w:1", max_concurrency: {size}}}]}}}}\n'


def size_of(config: GatewayConfig) -> int:
    return config.models["m"].endpoints[0].max_concurrency


async def test_an_apply_that_raises_is_counted_and_the_file_retried(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(config_text(1))
    errors = BackgroundErrors()
    attempts: list[int] = []
    applied = asyncio.Event()

    async def apply(config: GatewayConfig) -> None:
        attempts.append(size_of(config))
        if len(attempts) == 1:
            raise RuntimeError("failed half-way")
        applied.set()

    watcher = ConfigWatcher(str(path), apply, errors, interval_s=0.01)
    await watcher.start()
    try:
        path.write_text(config_text(2))
        await asyncio.wait_for(applied.wait(), 10)
        assert attempts == [2, 2]  # the same file, tried again after the failure
        assert errors.counts["reload"] == 1
        assert await watcher.check() is False  # recorded as applied now: not applied again
        applied.clear()
        path.write_text(config_text(3))  # and the loop still runs
        await asyncio.wait_for(applied.wait(), 10)
        assert attempts == [2, 2, 3]
    finally:
        await watcher.close()


async def test_a_file_that_does_not_load_is_refused_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(config_text(1))
    calls: list[GatewayConfig] = []

    async def apply(config: GatewayConfig) -> None:
        calls.append(config)

    watcher = ConfigWatcher(str(path), apply, BackgroundErrors())
    path.write_text("models: {m: {endpoints: []}}\n")
    with caplog.at_level(logging.ERROR, logger="gateway.reload"):
        assert await watcher.check() is False
        assert await watcher.check() is False
    assert calls == []
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
    path.write_text(config_text(4))
    assert await watcher.check() is True and size_of(calls[0]) == 4


# --- redis.on_outage follows reloads ---------------------------------------------------------

DEAD_REDIS = "redis://127.0.0.1:1/0"  # nothing listens there: every call fails as an outage


def outage_config(on_outage: str, spool_dir: Path, lease_ttl_s: int = 5) -> GatewayConfig:
    return parse_config(
        f'redis: {{url: "{DEAD_REDIS}", lease_ttl_s: {lease_ttl_s}, command_timeout_s: 0.5,'
        f" on_outage: {on_outage}}}\n"
        f'usage: {{spool_dir: "{spool_dir}"}}\n'
        "health: {interval_s: 300, unhealthy_after: 100}\n"  # the endpoint stays in rotation
        'models: {m: {endpoints: [{url: "http://127.0.0.1:1", max_concurrency: 2}]}}\n',
        "outage.yaml",
    )


async def outage_answer(state: GatewayState) -> str:
    """How admission answers a request while Redis is unreachable: a local lease, or why not."""
    plan = plan_candidates("m", None, fail_fast=False, registry=state.registry, allowed=None)
    try:
        admitted = await asyncio.wait_for(state.admission.admit(plan, "t-reload", 10), 10)
    except (Limited, Unavailable) as refused:
        return refused.reason.value
    state.admission.release(admitted.lease)
    return "local" if admitted.lease.local else admitted.lease.endpoint


async def test_on_outage_follows_a_reload_and_the_rest_of_redis_waits_for_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = GatewayState(outage_config("reject", tmp_path))
    state.admission.local.saw([state.admission.replica_id])  # alone in the fleet
    try:
        assert await outage_answer(state) == "store_unreachable"
        with caplog.at_level(logging.WARNING, logger="gateway"):
            await state.apply(outage_config("local", tmp_path))
        assert not [r for r in caplog.records if "restart" in r.getMessage()]
        assert await outage_answer(state) == "local"
        with caplog.at_level(logging.WARNING, logger="gateway"):
            await state.apply(outage_config("reject", tmp_path, lease_ttl_s=9))
        restart_only = [r.getMessage() for r in caplog.records if "restart" in r.getMessage()]
        assert restart_only == ["config reload: redis change only on restart"]
        assert state.config.redis.lease_ttl_s == 5  # the running value stays
        assert state.config.redis.on_outage == "reject"
        assert await outage_answer(state) == "store_unreachable"
    finally:
        await asyncio.wait_for(state.close(), 10)


class Applied:
    """An `apply` that records the size of each config it is given, in order."""

    def __init__(self) -> None:
        self.sizes: asyncio.Queue[int] = asyncio.Queue()

    async def __call__(self, config: GatewayConfig) -> None:
        self.sizes.put_nowait(size_of(config))

    async def next(self) -> int:
        return await asyncio.wait_for(self.sizes.get(), 10)

    def taken(self) -> list[int]:
        return [self.sizes.get_nowait() for _ in range(self.sizes.qsize())]


def config_file(tmp_path: Path, size: int) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(config_text(size))
    return path


async def test_a_changed_file_is_applied_by_the_watchers_own_round(tmp_path: Path) -> None:
    path, applied = config_file(tmp_path, 1), Applied()
    watcher = ConfigWatcher(str(path), applied, BackgroundErrors(), interval_s=0.01)
    await watcher.start()
    try:
        path.write_text(config_text(5))
        assert await applied.next() == 5
    finally:
        await watcher.close()
    assert applied.taken() == []  # applied once, not once per round


async def test_an_unchanged_file_is_not_applied(tmp_path: Path) -> None:
    path, applied = config_file(tmp_path, 1), Applied()
    watcher = ConfigWatcher(str(path), applied, BackgroundErrors())
    assert await watcher.check() is False  # the file in force at start
    path.write_text(config_text(1))  # rewritten, same content (a ConfigMap resync)
    assert await watcher.check() is False
    path.write_text(config_text(2))
    assert await watcher.check() is True
    assert await watcher.check() is False  # applied once
    assert applied.taken() == [2]


async def test_a_missing_file_keeps_the_running_config(tmp_path: Path) -> None:
    """Between the unlink and the new link of a ConfigMap swap the file is gone: nothing is
    applied, nothing refused, and the file that comes back is applied."""
    path, applied = config_file(tmp_path, 1), Applied()
    watcher = ConfigWatcher(str(path), applied, BackgroundErrors())
    path.unlink()
    assert await watcher.check() is False
    path.write_text(config_text(6))
    assert await watcher.check() is True
    assert applied.taken() == [6]


class Refusals(logging.Handler):
    """The watcher's refusal lines, with an event set at the first (the log line is the
    only trace a refusal leaves)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "refused" in record.getMessage():
            self.lines.append(record.getMessage())
            self.seen.set()


async def test_the_loop_refuses_an_invalid_file_then_applies_the_next_good_one(
    tmp_path: Path,
) -> None:
    path, applied, errors = config_file(tmp_path, 1), Applied(), BackgroundErrors()
    refusals = Refusals()
    logger = logging.getLogger("gateway.reload")
    logger.addHandler(refusals)
    watcher = ConfigWatcher(str(path), applied, errors, interval_s=0.01)
    await watcher.start()
    try:
        path.write_text("models: [not, a, mapping]\n")
        await asyncio.wait_for(refusals.seen.wait(), 10)
        path.write_text(config_text(7))
        assert await applied.next() == 7
    finally:
        await watcher.close()
        logger.removeHandler(refusals)
    assert len(refusals.lines) == 1  # one line, however many rounds saw the file
    assert "running config stays" in refusals.lines[0]
    assert errors.counts["reload"] == 0  # a refused file is no error of the watcher
    assert applied.taken() == []


async def test_sighup_checks_at_once(tmp_path: Path) -> None:
    path, applied = config_file(tmp_path, 1), Applied()
    # No round before the test's bound: only the signal can make it check.
    watcher = ConfigWatcher(str(path), applied, BackgroundErrors(), interval_s=3600)
    await watcher.start()
    try:
        if signal.getsignal(signal.SIGHUP) in (signal.SIG_DFL, signal.SIG_IGN, None):
            pytest.skip("no SIGHUP handler here (not the main thread)")
        path.write_text(config_text(8))
        os.kill(os.getpid(), signal.SIGHUP)
        assert await applied.next() == 8
    finally:
        await watcher.close()
