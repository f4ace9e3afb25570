"""The config watcher: a file that does not load is refused once; an apply that fails is
counted and tried again on the next round; the watcher itself never stops."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from gateway.reload import ConfigWatcher
from gateway.settings import GatewayConfig
from routing.background import BackgroundErrors


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
