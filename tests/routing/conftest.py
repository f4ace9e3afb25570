"""Fixtures of the routing tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from routing.store.scripts import Scripts
from tests.redis_server import RedisServer


@pytest.fixture(params=["functions", "scripts"])
def script_modes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test of a module that asks for it runs twice: with the scripts as a library of
    Redis Functions (Redis 7), and as plain scripts by EVALSHA (Redis 6.2, or an ACL without
    FUNCTION): the same Lua, bound two ways (routing/store/scripts.py)."""
    monkeypatch.setattr(
        Scripts.__init__, "__kwdefaults__", {"functions": request.param == "functions"}
    )
    return str(request.param)


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    servers = [RedisServer(tmp_path).start(), RedisServer(tmp_path).start()]
    try:
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()
