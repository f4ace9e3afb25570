"""A model's partitions (`models.<m>.partitions: K`, docs/config.md): its endpoints split over
K hash tags, so one hot model's admissions spread over K Redis Cluster masters.

Each partition is a model of its own to the scripts (routing/admission/slots.py): its keys
behind its own hash tag, its endpoints, its queue, its tier ceilings. An endpoint belongs to
exactly one partition (a rendezvous hash of its URL: `partition_of`), so no endpoint is ever
counted in two, and adding or removing endpoints moves no other one (a replica that has not
reloaded yet agrees on every endpoint both know). The first partition keeps the model's own
name (`partitions: 1` is the model as before); the others are named so that their hash slots
sit a K-th of the slot space apart from each other: on a Cluster whose masters each own a
contiguous range (as `redis-cli --cluster create` splits them), K partitions land on
min(K, masters) masters.

A request tries its partitions in turn (routing/admission/admit.py): its preferred one first
(by its prefix-cache key, else in rotation), then the others, taking the first slot with
room; only the last may queue, and it is the partition whose queue was shortest for the
request's tier at the last sweep. Partitions with no endpoint in rotation are skipped (with
few endpoints per partition the hash may leave one empty).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from hashlib import blake2b
from typing import TypeVar

from redis.crc import key_slot

from routing.admission.slots import ModelSlots
from routing.choice.affinity import Ring
from tiers.policy import Tier

SLOTS = 16384
# Names tried per partition when looking for a hash slot near its target: the closest one
# found is within a few slots of it.
_SEARCH = 1024
# Partition names: a character model names never hold (routing/registry.py).
SEPARATOR = "~"

T = TypeVar("T")


@functools.lru_cache(maxsize=1024)
def partition_names(model: str, k: int) -> tuple[str, ...]:
    """The names (hash tags) of `model`'s `k` partitions; the first is the model's own."""
    if k <= 1:
        return (model,)
    base = key_slot(model.encode())
    names = [model]
    for p in range(1, k):
        target = (base + p * SLOTS // k) % SLOTS
        best = min(
            range(_SEARCH),
            key=lambda n: _distance(key_slot(f"{model}{SEPARATOR}{p}.{n}".encode()), target),
        )
        names.append(f"{model}{SEPARATOR}{p}.{best}")
    return tuple(names)


def _distance(slot: int, target: int) -> int:
    d = abs(slot - target)
    return min(d, SLOTS - d)


def partition_of(url: str, k: int) -> int:
    """The partition of the endpoint `url` among `k`: rendezvous hashing, so an endpoint
    stays where it is when others come or go (only a change of `k` moves endpoints, about a
    k-th of them), and every replica agrees without asking anyone."""
    return max(range(k), key=lambda p: blake2b(f"{p}\x00{url}".encode(), digest_size=8).digest())


def split(items: Sequence[T], k: int, url: Callable[[T], str]) -> list[list[T]]:
    """`items` (the model's endpoints) by partition, each list in config order."""
    dealt: list[list[T]] = [[] for _ in range(k)]
    for item in items:
        dealt[partition_of(url(item), k) if k > 1 else 0].append(item)
    return dealt


class Rotation:
    """The order in which one request tries a model's partitions."""

    def __init__(self, parts: Sequence[str]) -> None:
        self.parts = list(parts)
        self._ring = Ring(self.parts)
        self._next = 0

    def order(
        self,
        cache_key: str | None,
        may_wait: bool,
        tier: Tier,
        slots: Mapping[str, ModelSlots],
    ) -> list[tuple[str, bool]]:
        """(partition, may it queue there) in the order to try them. `slots`: the slots by
        name, each with the waiters per tier its last sweep found (`seen_queue`)."""
        parts = self.parts
        if len(parts) == 1:
            return [(parts[0], may_wait)]
        if cache_key is not None:
            start = parts.index(self._ring.preferred(cache_key, 1)[0])
        else:
            start, self._next = self._next, (self._next + 1) % len(parts)
        # Partitions with no endpoint in rotation are left out: nothing to take there, and a
        # waiter there would wait for nothing.
        order = [p for p in parts[start:] + parts[:start] if slots[p].capacity > 0]
        if not may_wait or not order:
            return [(p, False) for p in order]

        def ahead(part: str) -> int:
            seen = slots[part].seen_queue
            return sum(n for t, n in seen.items() if t.rank <= tier.rank)

        last = min(order, key=ahead)  # the first of the shortest queues
        return [(p, False) for p in order if p != last] + [(last, True)]
