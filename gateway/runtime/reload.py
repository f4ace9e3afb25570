"""Live config: the gateway notices a changed config file and applies it.

Kubernetes updates a mounted ConfigMap by swapping a symlink, so there is no reliable file
event to wait for: the file's content is compared every `interval_s` (cheap: one small read),
and SIGHUP checks at once. A file that does not load is refused with one log line naming
the problem, and the config in force stays. An apply that fails unexpectedly is counted
(background task "reload") and retried on the next round; the watcher never stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from gateway.runtime.settings import ConfigError, GatewayConfig, load_config
from routing.background import BackgroundErrors, every

log = logging.getLogger("gateway.reload")


class ConfigWatcher:
    def __init__(
        self,
        path: str,
        apply: Callable[[GatewayConfig], Awaitable[None]],
        errors: BackgroundErrors,
        *,
        interval_s: float = 2.0,
    ) -> None:
        self._path = Path(path)
        self._apply = apply
        self._errors = errors
        self._interval = interval_s
        self._seen = self._digest()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # The wait is part of each round (SIGHUP cuts it short), so no pause between rounds.
        self._task = loop.create_task(every("reload", 0.0, self._round, self._errors))
        # Not the main thread, or no SIGHUP on this platform: polling still works.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, self._wake.set)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)

    async def _round(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), self._interval)
        self._wake.clear()
        await self.check()

    async def check(self) -> bool:
        """Apply the file if it changed since last seen; True when a new config applied.
        An error from `apply` propagates, and the file counts as unseen (tried again)."""
        digest = self._digest()
        if digest is None or digest == self._seen:
            return False
        try:
            config = load_config(self._path)
        except ConfigError as exc:
            self._seen = digest  # refused once, not again every round
            log.error("config reload refused, the running config stays: %s", exc)
            return False
        await self._apply(config)
        self._seen = digest
        return True

    def _digest(self) -> str | None:
        try:
            return hashlib.sha256(self._path.read_bytes()).hexdigest()
        except OSError:
            return None
