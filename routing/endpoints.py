"""A model's endpoints as this replica holds them, with its own in-flight counts.

Admission picks the endpoint of each lease from counts shared in Redis (routing/slots.py);
these local counts and `Pool.pick` serve only while Redis is away (`on_outage: local`).
"""

from __future__ import annotations

from collections.abc import Iterable

from routing.registry import EndpointConfig, Model


class Endpoint:
    """One worker serving one model, with this replica's in-flight count."""

    __slots__ = ("config", "inflight", "model_name", "upstream_model", "url")

    def __init__(self, model_name: str, config: EndpointConfig) -> None:
        self.config = config
        self.model_name = model_name
        self.url = config.base_url
        self.upstream_model = config.model or model_name
        self.inflight = 0


class Pool:
    """The endpoints of one model."""

    __slots__ = ("_turn", "by_url", "endpoints")

    def __init__(self, model: Model) -> None:
        self.endpoints = [Endpoint(model.name, e) for e in model.config.endpoints]
        self.by_url = {e.url: e for e in self.endpoints}
        self._turn = 0

    def pick(self) -> Endpoint:
        """Fewest in flight; ties go round-robin so equal endpoints share the load evenly."""
        endpoints = self.endpoints
        least = min(e.inflight for e in endpoints)
        tied = [e for e in endpoints if e.inflight == least]
        self._turn = (self._turn + 1) % len(tied) if len(tied) > 1 else 0
        return tied[self._turn]


class Pools:
    """Model name -> Pool."""

    def __init__(self, models: Iterable[Model]) -> None:
        self._pools = {m.name: Pool(m) for m in models}

    def for_model(self, name: str) -> Pool:
        return self._pools[name]

    def apply(self, models: Iterable[Model]) -> None:
        """A new config: pools rebuilt. Models that left keep theirs, since requests in
        flight may still look their endpoints up."""
        self._pools.update({m.name: Pool(m) for m in models})
