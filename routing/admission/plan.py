"""The fallback walk of docs/api.md: which models to try, in order, and which may queue."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from routing.errors import UnknownModel
from routing.registry import Api, Model, Registry
from tiers.policy import Tier
from tiers.resolve import applied_tier


# Not frozen, treated as immutable: a frozen dataclass's __init__ costs 3.5 times as much
# (0.52 against 0.15 us), and one is made per request (hot path); hashable all the same.
@dataclass(slots=True, unsafe_hash=True)
class Candidate:
    model: Model
    # Position in the caller's de-duplicated list: billed as `fallback_index`.
    index: int
    # Whether this entry may wait in the model's queue (only the last one, without fail_fast).
    may_wait: bool
    # The tier this request rides on this model (the one asked for, if model and key allow it).
    tier: Tier = Tier.DEFAULT


def plan_candidates(
    requested: str,
    fallbacks: Sequence[str] | None,
    *,
    fail_fast: bool,
    registry: Registry,
    allowed: Collection[str] | None,
    wanted: Tier = Tier.DEFAULT,
    allowed_tiers: Collection[Tier] | None = None,
    api: Api = "completions",
) -> list[Candidate]:
    """Models to try in order, each with the tier it applies. Unknown names (or names the
    key may not use, or models whose workers do not serve `api`) are skipped."""
    names = list(dict.fromkeys(fallbacks)) if fallbacks else [requested]
    known: list[tuple[int, Model]] = []
    unserved: list[str] = []
    for index, name in enumerate(names):
        model = registry.get(name)
        if model is not None and (allowed is None or name in allowed):
            if api in model.config.serves:
                known.append((index, model))
            else:
                unserved.append(name)
    if not known:
        raise _unknown(names, unserved, api)
    last = len(known) - 1
    return [
        Candidate(
            model,
            index,
            may_wait=(pos == last and not fail_fast),
            tier=applied_tier(wanted, model.tiers, allowed_tiers),
        )
        for pos, (index, model) in enumerate(known)
    ]


def _unknown(names: Sequence[str], unserved: Sequence[str], api: Api) -> UnknownModel:
    if unserved:
        shown = ", ".join(repr(n) for n in unserved)
        return UnknownModel(
            f"The model {shown} does not serve the {api} API here (its config `serves`)."
        )
    shown = ", ".join(repr(n[:256]) for n in names)
    return UnknownModel(f"The model {shown} does not exist or is not available to this key.")
