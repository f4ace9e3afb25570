"""Rate limits: requests and tokens per minute of a key and of its account, exact across
replicas (docs/architecture.md, "Rate limits").

Each limit is a GCRA bucket in Redis (routing/store/lua/ratelimit.lua), all of an account's
in one HASH under the account's hash tag, `gw:rl:{<tag>}`, beside its concurrency count
`gw:acct:{<tag>}` (the tag: the account's digest, slots.py `account_tag`; the same Redis
Cluster node). A walk's first try takes the charge in
the same batch as its acquire (routing/admission/acquire.py): one request, and its token
reservation (its estimated prompt and its answer capped by the first candidate's
`max_tokens_default`). A walk that admits nothing gives the charge back; a release trues
the token charge up to the tokens its record says were used, in the release's batch
(routing/store/lua/ratelimit_settle.lua). A request without limits sends none of this.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from routing.admission.handback import Handback
from routing.admission.plan import Candidate
from routing.admission.tokens import TokenAsk
from routing.errors import Limited, LimitReason
from routing.quotas import Quota, Quotas
from routing.store.keys import rate_key
from routing.store.scripts import STORE_ERRORS, Call

WINDOW_MS = 60_000
# ratelimit.lua's statuses.
TAKEN, REFUSED_REQUESTS, REFUSED_TOKENS, NEVER = 1, 0, -1, -2


@dataclass(frozen=True, slots=True)
class RateLimits:
    """The limits a key's requests meet: its own and its account's (None: no limit)."""

    account: str
    key_id: str  # never the key: its digest's first hex digits
    rpm: int | None = None
    tpm: int | None = None
    account_rpm: int | None = None
    account_tpm: int | None = None

    @property
    def tokens(self) -> bool:
        return self.tpm is not None or self.account_tpm is not None

    def buckets(self, kinds: str = "rt") -> list[Any]:
        """The script's pairs (field, limit per minute) of the buckets of `kinds`."""
        found: list[Any] = []
        pairs = (("r", self.rpm, self.account_rpm), ("t", self.tpm, self.account_tpm))
        for kind, own, whole in pairs:
            if kind in kinds and own is not None:
                found += (f"{kind}:{self.key_id}", own)
            if kind in kinds and whole is not None:
                found += (kind, whole)
        return found

    def unknown(self) -> Quotas:
        """The limits alone (the strictest of key and account), where Redis did not say
        what is left."""
        return Quotas(_lowest(self.rpm, self.account_rpm), _lowest(self.tpm, self.account_tpm))


def rate_limits(
    account: str,
    key_id: str,
    rpm: int | None,
    tpm: int | None,
    account_rpm: int | None,
    account_tpm: int | None,
) -> RateLimits | None:
    """The limits of a key, None when neither it nor its account has one."""
    if rpm is None and tpm is None and account_rpm is None and account_tpm is None:
        return None
    return RateLimits(account, key_id, rpm, tpm, account_rpm, account_tpm)


def _lowest(*limits: int | None) -> Quota | None:
    known = [n for n in limits if n is not None]
    return Quota(min(known)) if known else None


@dataclass(frozen=True, slots=True)
class RateCharge:
    """What a walk's take charged (one request, `tokens`) and what the buckets said."""

    limits: RateLimits
    tokens: int
    quotas: Quotas

    def refunded(self) -> Quotas:
        """The quotas as they stand once the charge went back (a walk that admitted nothing)."""
        requests, tokens = self.quotas.requests, self.quotas.tokens
        return Quotas(_refund(requests, 1), _refund(tokens, self.tokens))


def failed_quotas(
    limits: RateLimits | None, charge: RateCharge | None, *, asked: bool = True
) -> Quotas | None:
    """What a walk that admitted nothing reports: the buckets once its charge went back,
    else (nothing charged, or Redis did not say) the limits alone; None for a walk that
    never asked the buckets (`asked`: every candidate too large or without an endpoint),
    whose answer reads them as one before admission does."""
    if charge is not None:
        return charge.refunded()
    return limits.unknown() if limits is not None and asked else None


def _refund(quota: Quota | None, cost: int) -> Quota | None:
    if quota is None or quota.remaining is None or quota.reset_ms is None:
        return quota
    reset = max(0, quota.reset_ms - math.floor(cost * WINDOW_MS / quota.limit))
    return Quota(quota.limit, min(quota.limit, quota.remaining + cost), reset)


def quotas_of(reply: Sequence[Any]) -> Quotas:
    """ratelimit.lua's reply, its limits by kind."""
    limit, remaining, reset = (int(x) for x in reply[2:5])
    requests = Quota(limit, remaining, reset) if limit else None
    limit, remaining, reset = (int(x) for x in reply[5:8])
    return Quotas(requests, Quota(limit, remaining, reset) if limit else None)


class Rates:
    """The calls on the buckets: the take (sent by the acquire with a walk's first try), a
    read of them, the give-back of a walk that admitted nothing, the true-up at release."""

    def __init__(self, handback: Handback) -> None:
        self.scripts, self.store = handback.scripts, handback.store
        self.handback = handback

    @staticmethod
    def charge_of(limits: RateLimits, tokens: TokenAsk | None, plan: Sequence[Candidate]) -> int:
        """A request's token charge: its reservation, its answer capped by the first
        candidate's `max_tokens_default` (0 without a tokens limit)."""
        if not limits.tokens or tokens is None or not plan:
            return 0
        return tokens.reservation(plan[0].model.config.max_tokens_default)

    @staticmethod
    def take(limits: RateLimits, tokens: int) -> Call:
        return ("ratelimit", [rate_key(limits.account)], ["1", tokens, *limits.buckets()])

    @staticmethod
    def taken(limits: RateLimits, tokens: int, reply: Sequence[Any]) -> RateCharge:
        """The take's reply: the charge, or the 429 (`Limited`, carrying the quotas)."""
        status, quotas = int(reply[0]), quotas_of(reply)
        charge = RateCharge(limits, tokens, quotas)
        if status == TAKEN:
            return charge
        refusal = _refusal(status, int(reply[1]), charge)
        refusal.quotas = quotas
        raise refusal

    async def peek(self, limits: RateLimits) -> Quotas:
        """The buckets as they stand, for an answer that never reached admission (a 404,
        a 422); the limits alone when Redis does not answer."""
        call = ("ratelimit", [rate_key(limits.account)], ["0", 0, *limits.buckets()])
        try:
            return quotas_of(await asyncio.shield(self.scripts.call(self.store, call)))
        except STORE_ERRORS:
            return limits.unknown()

    def give_back(self, charge: RateCharge) -> None:
        """A walk that admitted nothing: its charge back, now (whatever its caller does)."""
        self._send(_settle(charge.limits, -1, -charge.tokens, "rt"))

    def late(self, limits: RateLimits, tokens: int, at: int, sent: asyncio.Future[Any]) -> None:
        """A take whose walk was cancelled before its reply came: given back if it took."""
        if sent.cancelled() or sent.exception() is not None:
            return  # in doubt: the buckets refill within the minute
        reply = sent.result()[at]
        if not isinstance(reply, Exception) and int(reply[0]) == TAKEN:
            self._send(_settle(limits, -1, -tokens, "rt"))

    def settle(self, charge: RateCharge, usage: Mapping[str, str] | None) -> Call | None:
        """The true-up at release: the tokens the record says were used (prompt and
        completion) instead of the reservation charged; None when there is nothing to do."""
        if usage is None or not charge.limits.tokens:
            return None
        try:
            used = int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
        except (KeyError, ValueError):
            return None
        delta = used - charge.tokens
        return None if delta == 0 else _settle(charge.limits, 0, delta, "t")

    def _send(self, call: Call) -> None:
        sent = self.scripts.send(self.store, [call])
        sent.add_done_callback(self._answered)
        self.handback.track(sent)

    def _answered(self, sent: asyncio.Future[list[Any]]) -> None:
        failed = None if sent.cancelled() else sent.exception()
        if failed is None and not sent.cancelled():
            failed = sent.result()[0] if isinstance(sent.result()[0], Exception) else None
        if failed is not None:  # in doubt: the buckets refill within the minute
            self.handback.store_errors.report(failed, "rate limits")


def _settle(limits: RateLimits, requests: int, tokens: int, kinds: str) -> Call:
    args = [requests, tokens, *limits.buckets(kinds)]
    return ("ratelimit_settle", [rate_key(limits.account)], args)


def _refusal(status: int, wait_ms: int, charge: RateCharge) -> Limited:
    """A take refused: by a requests or a tokens bucket (when it would conform, at most a
    minute), or a charge larger than a whole tokens bucket (never: no retry helps)."""
    retry = min(60, max(1, math.ceil(wait_ms / 1000)))
    quotas, limits = charge.quotas, charge.limits
    if status == NEVER:
        limit = min(n for n in (limits.tpm, limits.account_tpm) if n is not None)
        return Limited(
            f"This request reserves {charge.tokens} tokens (its prompt and max_tokens), more "
            f"than the limit of {limit} tokens per minute: it can never be served under this "
            "limit. Ask for fewer max_tokens or send a shorter prompt.",
            LimitReason.RATE_LIMIT_TOKENS, WINDOW_MS // 1000, retryable=False,
        )  # fmt: skip
    if status == REFUSED_TOKENS:
        limit = quotas.tokens.limit if quotas.tokens else 0
        return Limited(
            f"Rate limit reached: {limit} tokens per minute (this request reserves "
            f"{charge.tokens}). Retry after {retry}s.",
            LimitReason.RATE_LIMIT_TOKENS, retry,
        )  # fmt: skip
    limit = quotas.requests.limit if quotas.requests else 0
    return Limited(
        f"Rate limit reached: {limit} requests per minute. Retry after {retry}s.",
        LimitReason.RATE_LIMIT_REQUESTS, retry,
    )  # fmt: skip
