"""Fixtures of the routing tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_server import RedisServer


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    servers = [RedisServer(tmp_path).start(), RedisServer(tmp_path).start()]
    try:
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()
