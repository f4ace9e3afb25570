"""The usage record of one admitted request, from what the edge saw of it (docs/usage.md).

The record is built as its stream entry in one pass (the release's, on the hot path), with
`UsageRecord.to_fields`'s names, order and text (None as "", a bool as "1"/"0"), and no typed
record between: making it and converting it cost twice the rest. The typed form is
`UsageRecord.from_fields` of these fields.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.completions.exchange import Exchange
from routing.admission.admit import Admitted
from tiers.policy import TiersConfig
from tiers.usage import MAX_SOURCE, MAX_USER, Outcome, cost_usd, utc_now_ms


def usage_fields(
    exchange: Exchange,
    admitted: Admitted,
    *,
    account: str,
    key_id: str,
    requested_model: str,
    requested_tier: str,
    user: str | None,
    source: str | None,
    payload: dict[str, Any],
    tiers: TiersConfig,
) -> dict[str, str]:
    """The record as its stream entry, in one pass (the module's docstring)."""
    (prompt, completion, estimated), status = _tokens(exchange, payload), exchange.status
    started, first = exchange.started, exchange.first_byte
    return {
        "request_id": exchange.rid,
        "ts": utc_now_ms(),
        "account": account,
        "key_id": key_id,
        "user": "" if user is None else user[:MAX_USER],
        "source": "" if source is None else source[:MAX_SOURCE],
        "requested_model": requested_model,
        "served_model": admitted.candidate.model.name,
        "fallback_index": str(admitted.candidate.index),
        "requested_tier": requested_tier,
        "tier": admitted.tier.value,
        "prompt_tokens": str(int(prompt)),  # a JSON true passes Usage.take as an int: "1"
        "completion_tokens": str(int(completion)),
        "estimated": "1" if estimated else "0",
        "status": str(status),
        "outcome": _outcome(status),
        "duration_ms": str(round((time.perf_counter() - started) * 1000, 3)),
        "queue_ms": str(round(admitted.lease.queued_ms, 3)),
        "ttft_ms": "" if first is None else str(round((first - started) * 1000, 3)),
        "cost_usd": str(_cost(prompt, completion, admitted, tiers, exchange.preempted)),
        "reserved_tokens": str(admitted.lease.tokens),
        "preempted": "1" if exchange.preempted else "0",
    }


def _tokens(exchange: Exchange, payload: dict[str, Any]) -> tuple[int, int, bool]:
    """(prompt, completion, estimated): the worker's usage, else an estimate from the
    request and the bytes streamed."""
    usage = exchange.usage
    if usage.reported:
        return usage.prompt_tokens, usage.completion_tokens, False
    return _estimate_prompt(payload), usage.streamed, True


def _cost(
    prompt: int, completion: int, admitted: Admitted, tiers: TiersConfig, preempted: bool
) -> float:
    """The price of what it used; a preempted admission, which gave its caller nothing,
    costs nothing."""
    if preempted:
        return 0.0
    price = admitted.candidate.model.config.price
    multiplier = tiers.policy(admitted.tier).price_multiplier
    return cost_usd(prompt, completion, price.input_per_mtok, price.output_per_mtok, multiplier)


def _outcome(status: int) -> Outcome:
    if status == 200:
        return "complete"
    if status == 499:
        return "cancelled"
    return "error"


def _estimate_prompt(payload: dict[str, Any]) -> int:
    """Prompt tokens when the worker never said: token ids counted, text at ~4 chars each
    (a batch's prompts summed)."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return sum(_estimate_prompt({"prompt": p}) for p in prompt)
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return max(1, len(prompt) // 4)
    chars = 0
    for message in payload.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            # Unknown part types may carry a "text" of any JSON type: only strings count.
            texts = (p.get("text") for p in content if isinstance(p, dict))
            chars += sum(len(t) for t in texts if isinstance(t, str))
    return max(1, chars // 4)
