"""A request's token reservation: what it holds of an endpoint's KV-cache budget while it
runs (docs/architecture.md, token budgets)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenAsk:
    """A request's prompt, estimated in tokens, and the answer it asked for (None: it named
    no max_tokens)."""

    prompt: int
    output: int | None = None

    def reservation(self, cap: int) -> int:
        """Its prompt and its answer, the answer at most the model's `max_tokens_default`
        (`cap`), which is also what one that named none reserves."""
        output = cap if self.output is None else min(self.output, cap)
        return self.prompt + output
