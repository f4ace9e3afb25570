"""A preempted flex request's second admission (gateway/completions/preempt.py `requeued`):
its wait is bounded by what is left of its caller's deadline, none left is a 429, and its
rate limits are not charged again while its answer's tokens still count."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from gateway.completions.exchange import Exchange, Parsed, Usage
from gateway.completions.preempt import requeued
from gateway.completions.streamusage import StreamUsage
from gateway.runtime.auth import Account
from gateway.schemas.chat import ChatRequest
from gateway.schemas.completions import CompletionRequest
from gateway.schemas.tokens import prompt_tokens
from routing.admission.admit import Admitted
from routing.admission.plan import Candidate
from routing.admission.ratelimit import RateCharge, RateLimits
from routing.quotas import Quotas
from tiers.policy import Tier, TiersConfig

ACCOUNT = Account("acme", "k" * 12, "d" * 64, 10, None, None, tpm=1000)
LIMITS = RateLimits("acme", "k" * 12, tpm=1000)


class Admission:
    """Admits every request, noting what it was asked."""

    def __init__(self) -> None:
        self.asked: list[dict[str, Any]] = []

    async def admit(self, candidates: list[Candidate], *args: Any, **kw: Any) -> Admitted:
        self.asked.append(kw)
        return Admitted(lease=SimpleNamespace(id="second"), candidate=candidates[0], tier=Tier.FLEX)  # type: ignore[arg-type]


def state(on_preempt: str) -> tuple[Any, Admission]:
    admission = Admission()
    counted = SimpleNamespace(labels=lambda *a: SimpleNamespace(inc=lambda: None))
    tiers = TiersConfig.model_validate({"flex": {"on_preempt": on_preempt}})
    found = SimpleNamespace(
        admission=admission, config=SimpleNamespace(tiers=tiers),
        metrics=SimpleNamespace(preemptions=counted),
    )  # fmt: skip
    return found, admission


def parsed(deadline_s: float | None, waited_s: float) -> Parsed:
    request = CompletionRequest.model_validate({"model": "m", "prompt": "abcd", "max_tokens": 8})
    started = time.perf_counter() - waited_s
    return Parsed("rid", started, ACCOUNT, {}, request, Tier.FLEX, None, None, deadline_s)


def exchange() -> Exchange:
    return Exchange("rid", time.perf_counter(), False, StreamUsage(), Usage(), status=429)


def first() -> Admitted:
    model = SimpleNamespace(name="m")
    candidate = Candidate(model, index=0, may_wait=True, tier=Tier.FLEX)  # type: ignore[arg-type]
    charge = RateCharge(LIMITS, 9, Quotas())
    return Admitted(SimpleNamespace(id="first"), candidate, Tier.FLEX, rate=charge)  # type: ignore[arg-type]


async def test_the_second_wait_is_what_is_left_of_the_deadline() -> None:
    found, admission = state("requeue")
    again = await requeued(found, parsed(10.0, waited_s=4.0), exchange(), first())
    assert again is not None
    left = admission.asked[0]["deadline_s"]
    assert 0 < left <= 6.0  # not the whole 10 s again
    assert admission.asked[0]["at_head"] is True


async def test_a_deadline_already_passed_is_answered_preempted() -> None:
    found, admission = state("requeue")
    assert await requeued(found, parsed(2.0, waited_s=3.0), exchange(), first()) is None
    assert admission.asked == []  # it never queued again


async def test_the_second_admission_is_not_charged_but_its_tokens_are_trued_up() -> None:
    # The first release trued the charge up to the preempted record's tokens; the second
    # holds a charge of none, so its release charges what its answer used, all of it.
    found, admission = state("requeue")
    again = await requeued(found, parsed(None, waited_s=0.0), exchange(), first())
    assert again is not None and again.rate is not None
    assert again.rate.tokens == 0 and again.rate.limits == LIMITS
    assert "rates" not in admission.asked[0]  # no second request charged


async def test_reject_never_admits_again() -> None:
    found, admission = state("reject")
    assert await requeued(found, parsed(None, waited_s=0.0), exchange(), first()) is None
    assert admission.asked == []


def test_what_admission_is_asked_counts_the_tools_the_body_forwards() -> None:
    # Parsed.tokens: the prompt's estimate, its tools' bytes / 4 (from the forwarded body),
    # the answer asked for, and how many answers.
    tool = {"type": "function", "function": {"name": "lookup", "description": "x" * 400}}
    messages = [{"role": "user", "content": "abcd"}]
    body = {"model": "m", "messages": messages, "n": 2, "max_tokens": 8, "tools": [tool]}
    request = ChatRequest.model_validate(body)
    asked = Parsed("rid", 0.0, ACCOUNT, body, request, Tier.FLEX, None, None).tokens()
    assert asked.prompt >= 100 + prompt_tokens(request)
    assert (asked.output, asked.sequences) == (8, 2)
