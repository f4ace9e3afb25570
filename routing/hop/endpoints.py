"""A model's endpoints as this replica holds them, with its own in-flight counts.

Admission picks the endpoint of each lease from counts shared in Redis (routing/admission/slots.py);
these local counts and `Pool.pick` (routing/choice/pick.py) serve only while Redis is away
(`on_outage: local`).

A config reload must never pull an endpoint from under a request (docs/architecture.md,
Live config): an endpoint whose URL stays keeps its object (and so its in-flight count) with the
new settings, and one that leaves stays findable, retired, while a lease still holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from routing.choice.pick import least_loaded
from routing.registry import EndpointConfig, Model


def _no_penalty(url: str) -> float:
    return 0.0


def _up(url: str) -> bool:
    return True


class Endpoint:
    """One worker serving one model, with this replica's in-flight count."""

    __slots__ = ("config", "inflight", "model_name", "upstream_model", "url")

    def __init__(self, model_name: str, config: EndpointConfig) -> None:
        self.model_name = model_name
        self.url = config.base_url
        self.inflight = 0
        self.configure(config)

    def configure(self, config: EndpointConfig) -> None:
        """New settings for the same URL (a reload); requests already sent keep theirs."""
        self.config = config
        self.upstream_model = config.model or self.model_name


class Pool:
    """The endpoints of one model, and those a reload removed while leases still held them."""

    __slots__ = ("_turn", "by_url", "endpoints", "retired")

    def __init__(self, model: Model) -> None:
        self.endpoints = [Endpoint(model.name, e) for e in model.config.endpoints]
        self.by_url = {e.url: e for e in self.endpoints}
        self.retired: dict[str, Endpoint] = {}
        self._turn = 0

    def find(self, url: str) -> Endpoint | None:
        """The endpoint at `url`, configured or retired; None when this replica does not
        know it (e.g. another replica's newer config granted it)."""
        found = self.by_url.get(url)
        return found if found is not None else self.retired.get(url)

    def pick(
        self, penalty: Callable[[str], float] = _no_penalty, up: Callable[[str], bool] = _up
    ) -> Endpoint | None:
        """The outage's choice (routing/choice/pick.py), by the scorers the acquire's
        follows: of the endpoints `up` (all, when none is), the lowest load relative to its
        size plus its worker's `penalty`; ties take turns. None when the model has no
        endpoint left (it left the config)."""
        endpoints = [e for e in self.endpoints if up(e.url)] or self.endpoints
        loads = [(e.inflight, e.config.max_concurrency, penalty(e.url)) for e in endpoints]
        self._turn += 1
        at = least_loaded(loads, self._turn)
        return None if at is None else endpoints[at]

    def apply(self, model: Model | None, in_use: Collection[str]) -> None:
        """A new config for this model (None: the model left). `in_use`: the URLs leases
        still hold; endpoints that left stay retired only while they are among them."""
        known = {**self.retired, **self.by_url}
        endpoints: list[Endpoint] = []
        name, configs = (model.name, model.config.endpoints) if model is not None else ("", ())
        for config in configs:
            endpoint = known.pop(config.base_url, None)
            if endpoint is None:
                endpoint = Endpoint(name, config)
            else:
                endpoint.configure(config)
            endpoints.append(endpoint)
        self.endpoints = endpoints
        self.by_url = {e.url: e for e in endpoints}
        self.retired = {url: e for url, e in known.items() if url in in_use}
        self._turn = 0


class Pools:
    """Model name -> Pool."""

    def __init__(self, models: Iterable[Model]) -> None:
        self._pools = {m.name: Pool(m) for m in models}

    def for_model(self, name: str) -> Pool | None:
        return self._pools.get(name)

    def find(self, model: str, url: str) -> Endpoint | None:
        """The endpoint of a lease, or None when this replica does not know it."""
        pool = self._pools.get(model)
        return pool.find(url) if pool is not None else None

    def pick(
        self,
        model: str,
        penalty: Callable[[str], float] = _no_penalty,
        up: Callable[[str], bool] = _up,
    ) -> Endpoint | None:
        pool = self._pools.get(model)
        return pool.pick(penalty, up) if pool is not None else None

    def apply(self, models: Iterable[Model], in_use: Iterable[tuple[str, str]] = ()) -> None:
        """A new config. `in_use`: the (model, endpoint URL) pairs that leases still hold;
        what the new config drops stays findable only while they do (pruned on each apply).
        A model that left keeps its pool while a lease holds one of its endpoints."""
        held: dict[str, set[str]] = {}
        for model_name, url in in_use:
            held.setdefault(model_name, set()).add(url)
        current = {m.name: m for m in models}
        for name, pool in list(self._pools.items()):
            model = current.get(name)
            pool.apply(model, held.get(name, set()))
            if model is None and not pool.retired:
                del self._pools[name]
        for name, model in current.items():
            if name not in self._pools:
                self._pools[name] = Pool(model)
