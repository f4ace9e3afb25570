"""The usage record of one admitted request, from what the edge saw of it (docs/usage.md)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from gateway.exchange import Exchange
from routing.admission import Admitted
from tiers.policy import TiersConfig
from tiers.usage import MAX_SOURCE, MAX_USER, Outcome, UsageRecord, cost_usd, cut


def usage_record(
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
) -> UsageRecord:
    prompt, completion, estimated = _tokens(exchange, payload)
    duration_ms, queue_ms, ttft_ms = _timings_ms(exchange, admitted)
    return UsageRecord(
        request_id=exchange.rid,
        ts=datetime.now(UTC).isoformat(timespec="milliseconds"),
        account=account,
        key_id=key_id,
        user=cut(user, MAX_USER),
        source=cut(source, MAX_SOURCE),
        requested_model=requested_model,
        served_model=admitted.candidate.model.name,
        fallback_index=admitted.candidate.index,
        requested_tier=requested_tier,
        tier=admitted.tier.value,
        prompt_tokens=prompt,
        completion_tokens=completion,
        estimated=estimated,
        status=exchange.status,
        outcome=_outcome(exchange.status),
        duration_ms=duration_ms,
        queue_ms=queue_ms,
        ttft_ms=ttft_ms,
        cost_usd=_cost(prompt, completion, admitted, tiers),
    )


def _tokens(exchange: Exchange, payload: dict[str, Any]) -> tuple[int, int, bool]:
    """(prompt, completion, estimated): the worker's usage, else an estimate from the
    request and the bytes streamed."""
    usage = exchange.usage
    if usage.reported:
        return usage.prompt_tokens, usage.completion_tokens, False
    return _estimate_prompt(payload), usage.streamed, True


def _timings_ms(exchange: Exchange, admitted: Admitted) -> tuple[float, float, float | None]:
    """(duration, queue wait, time to first byte or None) in milliseconds."""
    now = time.perf_counter()
    ttft_ms = None
    if exchange.first_byte is not None:
        ttft_ms = round((exchange.first_byte - exchange.started) * 1000, 3)
    return (
        round((now - exchange.started) * 1000, 3),
        round(admitted.lease.queued_ms, 3),
        ttft_ms,
    )


def _cost(prompt: int, completion: int, admitted: Admitted, tiers: TiersConfig) -> float:
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
    """Prompt tokens when the worker never said: token ids counted, text at ~4 chars each."""
    prompt = payload.get("prompt")
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
