"""How a model's config becomes its slots in Redis (routing/admission/admit.py `_add`): its
endpoints dealt over its partitions, each partition's share of the queue, the endpoints as
admission first knows them, and how each tier shares and preempts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from routing.admission.partitions import Rotation, partition_names, split
from routing.admission.slots import EndpointSpec, ModelSlots
from routing.admission.timing import Timing
from routing.registry import EndpointConfig, Model, Registry
from tiers.policy import Tier, TiersConfig

log = logging.getLogger("gateway.admission")


class Layout:
    """A config's models as slots: each model's partitions (routing/admission/partitions.py,
    the first named as the model), by name; the order a request tries them in; where each
    endpoint is; every partition's model (those a reload left too)."""

    def __init__(self, timing: Timing, *, declare_all: bool) -> None:
        self.timing = timing
        self.declare_all = declare_all
        self.slots: dict[str, ModelSlots] = {}
        self.rotations: dict[str, Rotation] = {}
        self.part_of: dict[tuple[str, str], str] = {}
        self.model_of: dict[str, str] = {}
        # The (model, endpoint url) pairs of the config now (`part_of` keeps those a reload
        # took away too: their requests in flight still release).
        self.configured: frozenset[tuple[str, str]] = frozenset()

    def capacity(self, model: str) -> int:
        """The slots of `model`'s endpoints in rotation, over all its partitions."""
        return sum(self.slots[p].capacity for p in self.rotations[model].parts)

    def live(self, model: str) -> int:
        """`model`'s partitions with an endpoint in rotation."""
        return sum(1 for p in self.rotations[model].parts if self.slots[p].capacity > 0)

    def apply(self, registry: Registry, tiers: TiersConfig) -> list[ModelSlots]:
        """A new config: new models (and partitions) get slots, known ones new ceilings
        and queue bounds. Models that left keep their slots (their requests in flight still
        release); partitions that left keep theirs too, with no endpoint: they admit no
        more. Returns the slots whose endpoints it emptied (their index to write)."""
        emptied: list[ModelSlots] = []
        self.configured = frozenset(
            (model.name, e.base_url) for model in registry for e in model.config.endpoints
        )
        for model in registry:
            before = self.rotations.get(model.name)
            self._add(model, tiers)
            for part in set(before.parts if before else ()) - set(self.rotations[model.name].parts):
                self.slots[part].set_endpoints([])
                emptied.append(self.slots[part])
        return emptied

    def _add(self, model: Model, tiers: TiersConfig) -> None:
        """Slots for each of the model's partitions (new names only: a partition that left
        with a reload keeps its slots, its requests in flight still release)."""
        parts = partition_names(model.name, model.config.partitions)
        rotation = self.rotations.get(model.name)
        if rotation is None or rotation.parts != list(parts):
            self.rotations[model.name] = Rotation(parts)
        utilization = {t: tiers.policy(t).max_utilization for t in Tier}
        dealt = split(model.config.endpoints, len(parts), url_of)
        max_queue = queue_share(model, dealt)
        for part, endpoints in zip(parts, dealt, strict=True):
            urls = [e.base_url for e in endpoints]
            slots = self.slots.get(part)
            if slots is None:
                slots = ModelSlots(
                    part, utilization, max_queue, self.timing, fairness(tiers),
                    preempt=preempting(tiers), declare_all=self.declare_all,
                )  # fmt: skip
                self.slots[part] = slots
                # Every endpoint is in rotation until health checks say otherwise, with
                # its configured budget (`auto`: none until its worker tells it).
                slots.configured = frozenset(urls)
                slots.set_endpoints([configured(e) for e in endpoints])
            else:
                slots.configure(utilization, max_queue, fairness(tiers), urls, preempting(tiers))
            for url in urls:
                self.part_of[model.name, url] = part
            self.model_of[part] = model.name

    def set_endpoints(self, model: str, endpoints: Sequence[EndpointSpec]) -> list[ModelSlots]:
        """The endpoints of `model` now in rotation: (url, max_concurrency, load penalty,
        and its effective token budget or None), as `EndpointSpec`, dealt to its
        partitions. Returns the slots of each (their index to write)."""
        by_part: dict[str, list[EndpointSpec]] = {p: [] for p in self.rotations[model].parts}
        for endpoint in endpoints:
            part = self.part_of.get((model, endpoint[0]))
            if part in by_part:
                by_part[part].append(endpoint)
        for part, mine in by_part.items():
            self.slots[part].set_endpoints(mine)
        return [self.slots[part] for part in by_part]


def indexed(slots: ModelSlots, sent: asyncio.Future[list[Any]]) -> None:
    """An index write's reply: one that failed, was refused (or may have) is written whole."""
    if sent.cancelled() or sent.exception() is not None:
        slots.rewrite()
    else:
        slots.indexed(sent.result()[0])


def queue_share(model: Model, dealt: Sequence[Sequence[EndpointConfig]]) -> int:
    """What each partition with endpoints may queue (only those queue): its share of the
    model's `max_queue`. A partition the hash left empty is said in the log."""
    filled = sum(1 for d in dealt if d)
    if filled < len(dealt):
        log.warning(
            "model %r: %d of its %d partitions got no endpoint (an endpoint's partition is "
            "a hash of its URL): fewer partitions, or more endpoints, spread it better",
            model.name[:256], len(dealt) - filled, len(dealt),
        )  # fmt: skip
    return -(-model.config.max_queue // max(filled, 1))


def url_of(endpoint: EndpointConfig) -> str:
    return endpoint.base_url


def configured(endpoint: EndpointConfig) -> EndpointSpec:
    """An endpoint as configured: no penalty yet, its budget if a number (`auto` is read
    from the worker later: routing/hop/budgets.py)."""
    budget = endpoint.max_tokens_in_flight
    return (
        endpoint.base_url,
        endpoint.max_concurrency,
        0.0,
        budget if isinstance(budget, int) else None,
    )


def fairness(tiers: TiersConfig) -> dict[Tier, str]:
    """How each tier shares between accounts (`tiers.<tier>.fairness`)."""
    return {t: tiers.policy(t).fairness for t in Tier}


def preempting(tiers: TiersConfig) -> set[Tier]:
    """The tiers whose requests may take the slot of a preemptible tier's (flex) request
    that has not started (`tiers.<tier>.may_preempt`): never a preemptible tier itself."""
    return {t for t in Tier if not t.preemptible and tiers.policy(t).may_preempt}
