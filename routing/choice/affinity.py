"""Prefix-cache affinity: requests that share a `prompt_cache_key` prefer a few endpoints.

A hash ring (consistent hashing): each endpoint stands at `POINTS` places on a circle, a key
at one, and the key prefers the first `k` distinct endpoints clockwise from it. Every
replica computes the same order for a key without shared state, only the keys of an
endpoint that leaves rotation move, and finding them costs one hash and a binary search
(O(log n) in the endpoints). A change of the set (health) makes the new ring from the old
one (`changed`), O(n) list work; each URL's points are hashed once per process.
Bounded load comes from admission, which takes the first of them that still has room, else
the least loaded endpoint (prelude_seats.lua `seat`, `take_any`).
"""

from __future__ import annotations

import functools
from bisect import bisect, insort
from collections.abc import Iterable
from hashlib import blake2b

# Places per endpoint: enough that keys spread within a few percent of even.
POINTS = 64


class Ring:
    __slots__ = ("_placed", "_points", "_urls", "distinct", "urls")

    def __init__(self, urls: Iterable[str], placed: list[tuple[int, str]] | None = None) -> None:
        self.urls = frozenset(urls)
        if placed is None:
            placed = sorted(p for url in self.urls for p in _points_of(url))
        self._placed = placed
        # The same points as two lists: what a lookup reads (a bisect over ints).
        self._points = [p for p, _ in placed]
        self._urls = [u for _, u in placed]
        self.distinct = len(self.urls)

    def changed(self, urls: Iterable[str]) -> Ring:
        """The ring of `urls`, made from this one: the points of endpoints that stay are
        kept in place, those that left dropped, those that came inserted (a few; many are
        sorted in at once). A health change costs O(n) list work, not a rebuild of
        n x POINTS hashes and a sort (92 ms at 1,000 endpoints, on the event loop)."""
        now = frozenset(urls)
        if now == self.urls:
            return self
        gone, came = self.urls - now, now - self.urls
        placed = [p for p in self._placed if p[1] not in gone] if gone else list(self._placed)
        if len(came) * 8 > len(now):
            placed = sorted(placed + [p for url in came for p in _points_of(url)])
        else:
            for url in came:
                for point in _points_of(url):
                    insort(placed, point)
        return Ring(now, placed)

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


@functools.lru_cache(maxsize=65536)
def _points_of(url: str) -> tuple[tuple[int, str], ...]:
    """An endpoint's places on the ring (hashed once per URL)."""
    return tuple((_place(f"{url}\x00{i}"), url) for i in range(POINTS))


def affinity_key(prompt_cache_key: str | None, cache_salt: str | None) -> str | None:
    if not prompt_cache_key:
        return None
    return prompt_cache_key if not cache_salt else f"{cache_salt}\x00{prompt_cache_key}"


def _place(text: str) -> int:
    # surrogatepass: a key holding a lone surrogate still hashes (the edge refuses those,
    # but hashing must never be what fails a request).
    digest = blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")
