"""A flex request preempted before its first byte (docs/api.md, preemption), as its route
sees it: the race between its worker's answer and the message that its slot was taken
(routing/admission/preemption.py), and what becomes of it then: a 429 `preempted`, or a
second admission at the head of the flex queue (`tiers.flex.on_preempt: requeue`).

The hop itself asks, before its first byte goes out, whether the lease is still its own
(gateway/completions/hop.py `Hop._first_byte`): a request that has started streaming is
never cut, and one preempted meanwhile sends nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Coroutine
from typing import Any

from gateway.completions.exchange import Exchange, Parsed, Usage
from gateway.runtime.state import GatewayState
from routing.admission.admit import Admission, Admitted
from routing.admission.plan import Candidate
from routing.errors import Preempted, RoutingError


async def unless_preempted(
    hop: Coroutine[Any, Any, None], admission: Admission, admitted: Admitted
) -> None:
    """Run the hop; if the request's slot is preempted before it has sent anything, cut it
    short (its worker's request closed, which frees the worker's cache) and raise
    `Preempted`."""
    if not admitted.preemptible:
        await hop
        return
    told = admission.preemptions.watch(admitted.lease.id)
    task = asyncio.ensure_future(hop)
    try:
        await asyncio.wait({task, told}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the caller went away, the server stops
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise preempted(admission, admitted)
    task.result()  # its own outcome, raised as it is


def preempted(admission: Admission, admitted: Admitted) -> Preempted:
    model = admitted.candidate.model.name
    return Preempted(
        f"This flex request's slot on {model!r} went to a request of a higher tier before "
        "its answer began; retry (flex takes only spare capacity).",
        admission.retry_after(model, 0),
    )


async def requeued(
    state: GatewayState, parsed: Parsed, exchange: Exchange, admitted: Admitted
) -> Admitted | None:
    """The preempted request's second admission, at the head of the flex queue of the same
    model, where `tiers.flex.on_preempt` says so; None to answer it 429 `preempted` (or
    when the second admission is refused, or its caller's deadline has passed: it is
    answered as preempted all the same).

    Its wait for the second slot is bounded by what is left of its deadline, not by the
    whole of it again. Its rate limits are not charged again (one request of its caller),
    but what its answer uses is: the first release trued the charge up to the preempted
    record's tokens, so the second admission holds a charge of none, trued up at its own
    release to what it used (the limits count what the usage records bill)."""
    left = time_left(parsed)
    tier = admitted.candidate.tier  # (a preemptible tier's: flex)
    policy = state.config.tiers.policy(tier)
    requeue = policy.on_preempt == "requeue" and (left is None or left > 0)
    model = admitted.candidate.model
    state.metrics.preemptions.labels(model.name, "requeued" if requeue else "rejected").inc()
    if not requeue:
        return None
    again = Candidate(model, index=admitted.candidate.index, may_wait=True, tier=tier)
    account = parsed.account
    tokens = parsed.tokens()
    try:
        second = await state.admission.admit(
            [again], account.name, account.max_concurrency, None, account.weight,
            tokens=tokens, deadline_s=left, at_head=True,
        )  # fmt: skip
    except RoutingError:
        return None
    if admitted.rate is not None:
        second.rate = dataclasses.replace(admitted.rate, tokens=0)
    exchange.status, exchange.usage, exchange.first_byte = 200, Usage(), None
    exchange.preempted = False
    return second


def time_left(parsed: Parsed) -> float | None:
    """What is left of the caller's deadline (x-request-timeout), None without one."""
    if parsed.deadline_s is None:
        return None
    return parsed.deadline_s - (time.perf_counter() - parsed.started)
