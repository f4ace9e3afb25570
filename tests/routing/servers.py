"""A locator that says which Redis server is the master, as the sentinels would: for the
tests that move a store between two servers (the `two` fixture, conftest.py)."""

from __future__ import annotations


class Locator:
    """Answers where the test says the master is; counts the questions."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.asked = 0

    async def locate(self) -> tuple[str, int]:
        self.asked += 1
        return "127.0.0.1", self.port

    async def aclose(self) -> None:
        pass
