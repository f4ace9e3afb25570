"""Prefix-cache affinity: requests that share a `prompt_cache_key` prefer one endpoint.

Rendezvous (highest-random-weight) hashing: every replica computes the same order of a
model's endpoints for a key, without shared state, and only the keys of an endpoint that
leaves rotation move. Bounded load comes from admission, which takes the first endpoint in
this order that still has room.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b


def rendezvous(key: str, urls: Sequence[str]) -> list[str]:
    """`urls` ordered by preference for `key` (stable across processes and restarts)."""
    return sorted(urls, key=lambda url: _weight(key, url), reverse=True)


def affinity_key(prompt_cache_key: str | None, cache_salt: str | None) -> str | None:
    if not prompt_cache_key:
        return None
    return prompt_cache_key if not cache_salt else f"{cache_salt}\x00{prompt_cache_key}"


def _weight(key: str, url: str) -> bytes:
    # surrogatepass: a key holding a lone surrogate still hashes (the edge refuses those,
    # but hashing must never be what fails a request).
    text = f"{key}\x00{url}".encode("utf-8", "surrogatepass")
    return blake2b(text, digest_size=8).digest()
