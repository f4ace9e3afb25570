"""A request's token reservation: what it holds of an endpoint's KV-cache budget while it
runs (docs/architecture.md, token budgets)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from routing.errors import TooLarge

if TYPE_CHECKING:
    from routing.admission.plan import Candidate
    from tiers.policy import Tier


@dataclass(frozen=True, slots=True)
class TokenAsk:
    """A request's prompt, estimated in tokens, the answer it asked for (None: it named no
    max_tokens), and how many answers (`n`: each its own sequence in the worker's cache,
    beside the one prompt they share)."""

    prompt: int
    output: int | None = None
    sequences: int = 1

    def reservation(self, cap: int) -> int:
        """Its prompt and its answers, each at most the model's `max_tokens_default`
        (`cap`), which is also what one that named none reserves."""
        output = cap if self.output is None else min(self.output, cap)
        return self.prompt + self.sequences * output


def reservation(
    candidates: Sequence[Candidate], tokens: TokenAsk | None, budgeted: Collection[str]
) -> int:
    """What a request reserves of an endpoint's token budget: its prompt estimate and its
    answer, capped by the largest `max_tokens_default` of its candidates whose models hold
    budgets (`budgeted`, by name); 0 when none does (or it said nothing). One figure for
    its whole walk: it is in its lease id (routing/admission/slots.py `make_lease_id`)."""
    if tokens is None:
        return 0
    caps = [c.model.config.max_tokens_default for c in candidates if c.model.name in budgeted]
    return tokens.reservation(max(caps)) if caps else 0


def too_large(
    model: str, tokens: int, largest: Sequence[int | None], tier: Tier, whole: int | None = None
) -> TooLarge | None:
    """The refusal of a reservation of `tokens` no endpoint of `model` could ever hold at
    `tier`, given each of its partitions' most a request of that tier may reserve
    (`ModelSlots.largest_budget`: None when an endpoint holds none, 0 when none is in
    rotation) and the largest whole budget (`whole`, for the message), else None."""
    budgets = [b for b in largest if b != 0]
    if not tokens or not budgets or None in budgets:
        return None
    budget = max(b or 0 for b in budgets)
    if tokens <= budget:
        return None
    holds = f"({budget} tokens)"
    if whole is not None and whole > budget:
        holds = (
            f"for the {tier.value} tier ({budget} tokens: a tier fills at most its "
            f"max_utilization of an endpoint's {whole})"
        )
    why = (
        f"This request needs about {tokens} tokens of a worker's KV cache (its prompt "
        f"and max_tokens, capped at {model!r}'s max_tokens_default), more than any "
        f"endpoint of {model!r} holds {holds}: shorten the prompt or lower max_tokens."
    )
    return TooLarge(why, tokens, budget)
