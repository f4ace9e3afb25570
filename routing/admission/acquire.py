"""One candidate's acquire in Redis: its model's slot, or a place in its queue, and with a
walk's first try the account's own slot, in the same round trip (docs/api.md).

`Walk` is one request's walk over its candidates (routing/admission/admit.py walks them). A call
whose caller went away is given back when its reply arrives (routing/admission/handback.py); a
request that may wait registers its waiter first (routing/admission/waiting.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from routing.admission import refusals
from routing.admission.handback import Handback
from routing.admission.ratelimit import RateCharge, RateLimits, Rates
from routing.admission.replies import Attempt, attempt
from routing.admission.slots import ACCOUNT_FULL, BUSY, GRANTED, NO_INDEX, PREFERRED, QUEUED
from routing.admission.timing import Timing
from routing.admission.waiting import Waiting
from routing.errors import Limited
from routing.store.scripts import first_error
from tiers.policy import Tier


@dataclass(slots=True)
class Walk:
    """One request's walk over its candidates."""

    lease_id: str
    account: str
    akey: str  # the account's key in Redis
    limit: int
    cache_key: str | None  # prefix-cache affinity: the endpoints in this key's order
    # Tokens it reserves of an endpoint's budget (its lease id carries them): 0 for none.
    tokens: int = 0
    # Whether the account's count holds an entry for this walk (taken with the first try).
    has_account: bool = False
    # The candidate being tried: an error out of the walk concerns it (its metric label).
    at: str = ""
    # Rate limits (routing/admission/ratelimit.py): the key's, its token charge, whether the
    # take went (with the walk's first try), and what it took once its reply came.
    rates: RateLimits | None = None
    rate_tokens: int = 0
    rated: bool = False
    charge: RateCharge | None = None
    # The caller's deadline (the clock's time, x-request-timeout) and, for the candidate
    # being tried, the most grants it may wait behind to meet it (None: no such bound);
    # a preempted request's second try queues at the head of its tier.
    deadline: float | None = None
    deadline_s: float = 0.0
    max_turn: int | None = None
    at_head: bool = False


class Acquire:
    def __init__(
        self, handback: Handback, waiting: Waiting, timing: Timing, clock: Callable[[], float]
    ) -> None:
        # The same store, slots and holdings as the give-backs.
        self.scripts, self.store = handback.scripts, handback.store
        self.slots, self.holdings = handback.slots, handback.holdings
        self.handback = handback
        self.rates = Rates(handback)
        self.waiting = waiting
        self.timing = timing
        self._clock = clock

    async def past_rebuild(
        self, walk: Walk, part: str, may_wait: bool, tier: Tier, deadline: float
    ) -> Attempt:
        """`try_one`; a request that may wait and finds the model being rebuilt (Redis lost
        its state, the prelude's `lost`) waits for the window to end and tries again until
        `deadline` (its queue timeout). Meanwhile it holds no account entry: the account's
        count may not be written back yet, so it is checked again after."""
        while True:
            result = await self.try_one(walk, part, may_wait, tier)
            left = deadline - self._clock()
            if not (result.rebuild_ms and may_wait and left > 0):
                return result
            self.holdings.waiters.pop(walk.lease_id, None)
            if self.holdings.walking.pop(walk.lease_id, None) is not None:
                walk.has_account = False
                self.handback.give_back(walk.lease_id, None, walk.akey)
            await asyncio.sleep(min(result.rebuild_ms / 1000, left))

    async def try_one(self, walk: Walk, part: str, may_wait: bool, tier: Tier) -> Attempt:
        """One candidate's acquire; the first also takes the account's own slot, in the same
        round trip (and the model's slot goes back if the account is at its limit). Where
        Redis holds no endpoint index for the model (a first start, Redis lost it), the
        index is written and the acquire sent again behind it, in one more round trip."""
        result = await self._try(walk, part, may_wait, tier, with_index=False)
        if result.status != NO_INDEX:
            return result
        self.slots[part].rewrite()
        result = await self._try(walk, part, may_wait, tier, with_index=True)
        # Still none (Redis refused the write): busy, as a model without room.
        return result if result.status != NO_INDEX else Attempt(BUSY, "", 0, 0, 0)

    async def _try(
        self, walk: Walk, model: str, may_wait: bool, tier: Tier, *, with_index: bool
    ) -> Attempt:
        """`model`: the slots' name (the model, or one of its partitions). A walk's first try
        with rate limits takes their charge first in the same batch; refused, whatever the
        acquire took goes back."""
        index = self.slots[model].index() if with_index else None
        rated = walk.rates is not None and not walk.rated
        calls = self._calls(walk, model, may_wait, tier)
        calls = [*([index] if index else []), *self._rate_calls(walk), *calls]
        with_account = not walk.has_account
        rate_at = int(bool(index)) if rated else None
        replies = await self._send(walk, model, calls, with_account, rate_at)
        if index:
            self.slots[model].indexed(replies[0])
        replies = replies[1:] if index else replies
        rate = replies.pop(0) if rated else None
        # On one Redis the acquire script itself takes the account's slot (one call).
        merged = with_account and self.store.one_node
        if with_account and _took_account(replies, merged):
            walk.has_account = True
            self.holdings.walking[walk.lease_id] = walk.akey
        refusal = None if rate is None or isinstance(rate, Exception) else self._rated(walk, rate)
        if (error := refusal or first_error([rate, *replies])) is not None:
            self._given_back(walk, model, replies[-1], merged and refusal is None)
            raise error
        result = attempt(replies[-1])
        if result.status == NO_INDEX:
            return result
        if not walk.has_account:
            if result.status in (GRANTED, QUEUED):
                self.handback.give_back(walk.lease_id, model, None, result.endpoint)
            raise refusals.account_full(walk.account, walk.limit)
        return result

    async def _send(
        self, walk: Walk, model: str, calls: list[Any], with_account: bool, rate_at: int | None
    ) -> list[Any]:
        """The batch, outliving its caller: a caller gone meanwhile gives back what the
        acquire took, and the rate charge (the call at `rate_at`) if it was taken."""
        sent = self.scripts.send(self.store, calls)
        walk.rated = walk.rated or rate_at is not None
        # Until its reply is in, a sweep counts the lease it may have taken as this
        # replica's (the local outage shares: routing/admission/keeper.py).
        self.holdings.acquiring[walk.lease_id] = model
        try:
            return await self.handback.outliving(
                sent, walk.lease_id, model, walk.akey if with_account else None
            )
        except asyncio.CancelledError:
            if rate_at is not None and walk.rates is not None:
                late = partial(self.rates.late, walk.rates, walk.rate_tokens, rate_at)
                sent.add_done_callback(late)
            raise
        finally:
            self.holdings.acquiring.pop(walk.lease_id, None)

    def _given_back(self, walk: Walk, model: str, acquired: Any, account: bool) -> None:
        """What a batch that failed or was refused took goes back: the acquire's slot or
        waiter (where its reply says, else looked for: a script that failed midway keeps
        what it wrote before), and the account's entry that the same call took (`account`;
        an entry the account's own call took goes back when the walk ends)."""
        if isinstance(acquired, Exception) or account:
            self.handback.give_back(walk.lease_id, model, walk.akey if account else None)
        elif (took := attempt(acquired)).status in (GRANTED, QUEUED):
            self.handback.give_back(walk.lease_id, model, None, took.endpoint)

    def _rate_calls(self, walk: Walk) -> list[Any]:
        """The rate limits' take, with the walk's first try only."""
        if walk.rates is None or walk.rated:
            return []
        return [self.rates.take(walk.rates, walk.rate_tokens)]

    def _rated(self, walk: Walk, reply: Any) -> Limited | None:
        """The take's reply: the charge kept on the walk, or its 429."""
        assert walk.rates is not None
        try:
            walk.charge = self.rates.taken(walk.rates, walk.rate_tokens, reply)
        except Limited as refusal:
            return refusal
        return None

    def _calls(self, walk: Walk, model: str, may_wait: bool, tier: Tier) -> list[Any]:
        calls: list[Any] = []
        account = None
        if not walk.has_account and self.store.one_node:
            account = (walk.akey, walk.limit)  # taken by the acquire script itself
        elif not walk.has_account:
            ttl = self.timing.lease_ttl_ms
            calls.append(("account", [walk.akey], [walk.lease_id, walk.limit, ttl]))
        if may_wait:
            # Registered before the call: a wake-up may arrive before the reply does.
            self.waiting.register(walk.lease_id, model)
        preferred = None
        if walk.cache_key is not None:
            preferred = self.slots[model].ring.preferred(walk.cache_key, PREFERRED)
        calls.append(
            self.slots[model].acquire(
                walk.lease_id,
                tier,
                may_wait=may_wait,
                affinity=preferred,
                account=account,
                max_turn=walk.max_turn,
                at_head=walk.at_head,
            )
        )
        return calls


def _took_account(replies: list[Any], merged: bool) -> bool:
    """Whether the account's entry was taken: by the acquire script itself (`merged`, one
    call), or by the account script (the first of two calls)."""
    reply = replies[0]
    if isinstance(reply, Exception):
        return False
    if merged:
        return attempt(reply).status not in (ACCOUNT_FULL, NO_INDEX)
    return int(reply) == 1
