"""Prefix-cache affinity: requests that share a `prompt_cache_key` prefer a few endpoints.

A hash ring (consistent hashing): each endpoint stands at `POINTS` places on a circle, a key
at one, and the key prefers the first `k` distinct endpoints clockwise from it. Every
replica computes the same order for a key without shared state, only the keys of an
endpoint that leaves rotation move, and finding them costs one hash and a binary search
(O(log n) in the endpoints; the ring is built once per change of the set, O(n log n)).
Bounded load comes from admission, which takes the first of them that still has room, else
the least loaded endpoint (routing/store/lua/prelude.lua `pick`).
"""

from __future__ import annotations

from bisect import bisect
from collections.abc import Iterable
from hashlib import blake2b

# Places per endpoint: enough that keys spread within a few percent of even.
POINTS = 64


class Ring:
    __slots__ = ("_points", "_urls", "distinct")

    def __init__(self, urls: Iterable[str]) -> None:
        placed = sorted((_place(f"{url}\x00{i}"), url) for url in set(urls) for i in range(POINTS))
        self._points = [p for p, _ in placed]
        self._urls = [u for _, u in placed]
        self.distinct = len(placed) // POINTS

    def preferred(self, key: str, k: int) -> list[str]:
        """The first `k` endpoints for `key` (fewer when the ring holds fewer)."""
        want = min(k, self.distinct)
        found: list[str] = []
        if want == 0:
            return found
        n = len(self._urls)
        at = bisect(self._points, _place(key))
        for step in range(n):
            url = self._urls[(at + step) % n]
            if url not in found:
                found.append(url)
                if len(found) == want:
                    break
        return found


def affinity_key(prompt_cache_key: str | None, cache_salt: str | None) -> str | None:
    if not prompt_cache_key:
        return None
    return prompt_cache_key if not cache_salt else f"{cache_salt}\x00{prompt_cache_key}"


def _place(text: str) -> int:
    # surrogatepass: a key holding a lone surrogate still hashes (the edge refuses those,
    # but hashing must never be what fails a request).
    digest = blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")
