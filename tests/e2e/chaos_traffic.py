"""The traffic of the randomized fault test (tests/e2e/test_chaos.py): a bounded number of
requests, a bounded number in flight, to whichever gateway replicas are live.

Request i is drawn from `random.Random(f"{seed}:{i}")` alone, so a seed replays the same
requests (their interleaving with faults depends on the machine). Each has a unique
x-request-id; some are streams, some chat, some go through the official openai SDK, some
are hung up by the client after a while (queued, or mid-stream: the connection is closed).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import httpx2
import openai

from tests.e2e.chaos_fleet import ChaosFleet, Replica

TIERS = ("priority", "default", "default", "default", "flex")
# Idle connections are dropped well before the server's keep-alive timeout (uvicorn: 5 s),
# or a request sent as the server closes one fails (a race of HTTP keep-alive, not a fault).
KEEPALIVE_S = 1.0


@dataclass(frozen=True)
class Spec:
    rid: str
    account: str
    tier: str
    fail_fast: bool
    stream: bool
    chat: bool
    sdk: bool
    max_tokens: int
    hangup_s: float | None  # the client closes the connection after this long


@dataclass
class Outcome:
    spec: Spec
    replica: Replica
    sent: float
    ended: float = 0.0
    status: int | None = None  # the HTTP status, None when no answer came
    answered: float = 0.0  # when the status came (a stream's first event)
    # The error code of a non-2xx answer; without an answer: hangup, connection or timeout.
    code: str = ""
    message: str = ""  # the error's message of a non-2xx answer (what the gateway said)
    completed: bool = False  # a 2xx read to its end ([DONE] for a stream)


@dataclass
class Driver:
    seed: int
    fleet: ChaosFleet
    keys: dict[str, str]  # account -> API key
    accounts: tuple[str, ...]  # drawn in this proportion
    timeout_s: float  # no answer by then is a hang
    hold_tokens: int  # the length of the long streams
    outcomes: list[Outcome] = field(default_factory=list)
    _sdks: dict[tuple[str, str], openai.AsyncOpenAI] = field(default_factory=dict)

    def spec(self, i: int) -> Spec:
        rng = random.Random(f"{self.seed}:{i}")
        stream = rng.random() < 0.45
        sdk = not stream and rng.random() < 0.35
        hangup = None if sdk or rng.random() > 0.12 else rng.uniform(0.02, 0.6)
        return Spec(
            rid=f"chaos-{self.seed}-{i}",
            account=rng.choice(self.accounts),
            tier=rng.choice(TIERS),
            fail_fast=rng.random() < 0.25,
            stream=stream,
            chat=rng.random() < 0.4,
            sdk=sdk,
            max_tokens=rng.choice((4, 8, 16)),
            hangup_s=hangup,
        )

    def hold_spec(self, lane: int, k: int) -> Spec:
        """A long stream of the account of the smallest limit. Two are in flight (or waiting)
        at almost any time, so most empty restarts find work that outlives the grace: unless
        written back, the newcomers overfill the workers holding them and the account."""
        return Spec(
            rid=f"chaos-{self.seed}-hold{lane}-{k}",
            account=self.accounts[0],
            tier="priority",
            fail_fast=False,
            stream=True,
            chat=False,
            sdk=False,
            max_tokens=self.hold_tokens,
            hangup_s=None,
        )

    async def run(self, budget: int, duration_s: float, in_flight: int) -> None:
        """Send up to `budget` requests over `duration_s`, `in_flight` at most: two lanes of
        long streams (`hold_spec`), the others paced evenly."""
        limits = httpx.Limits(
            max_connections=in_flight + 8,
            max_keepalive_connections=in_flight,
            keepalive_expiry=KEEPALIVE_S,
        )
        start = time.monotonic()
        end = start + duration_s
        holders = 2
        holds = max(1, budget // 40)  # per holder lane: long streams, and tries when refused
        gap = duration_s / (budget - holds * holders)
        numbers = itertools.count()
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as http:

            async def lane() -> None:
                for i in numbers:
                    due = start + i * gap
                    if i >= budget - holds * holders or due >= end:
                        return
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                    await self.one(http, self.spec(i), i)

            async def holder(n: int) -> None:
                for k in range(holds):
                    if time.monotonic() >= end:
                        return
                    out = await self.one(http, self.hold_spec(n, k), -1 - k - n * holds)
                    if out is None or out.status != 200:
                        await asyncio.sleep(0.05)  # refused: again, soon

            lanes = [lane() for _ in range(in_flight - holders)]
            try:
                await asyncio.gather(*(holder(n) for n in range(holders)), *lanes)
            finally:
                for client in self._sdks.values():
                    await client.close()

    async def one(self, http: httpx.AsyncClient, spec: Spec, i: int) -> Outcome | None:
        replica = self.fleet.pick(random.Random(f"{self.seed}:{i}:replica"))
        if replica is None:
            return None
        out = Outcome(spec, replica, time.monotonic())
        self.outcomes.append(out)
        sending = self._sdk(out) if spec.sdk else self._http(http, out)
        try:
            await asyncio.wait_for(sending, spec.hangup_s or self.timeout_s)
        except TimeoutError:
            out.code = "hangup" if spec.hangup_s else "timeout"
        except (httpx.TransportError, openai.APIConnectionError) as exc:
            timed_out = isinstance(exc, httpx.TimeoutException | openai.APITimeoutError)
            out.code = "timeout" if timed_out else "connection"
        finally:
            out.ended = time.monotonic()
        return out

    def _body(self, spec: Spec) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "m", "max_tokens": spec.max_tokens}
        if spec.chat:
            body["messages"] = [{"role": "user", "content": "chaos"}]
        else:
            body["prompt"] = "chaos"
        body.update(stream=spec.stream, fail_fast=spec.fail_fast, service_tier=spec.tier)
        return body

    async def _http(self, http: httpx.AsyncClient, out: Outcome) -> None:
        spec = out.spec
        path = "/v1/chat/completions" if spec.chat else "/v1/completions"
        headers = {"Authorization": f"Bearer {self.keys[spec.account]}", "x-request-id": spec.rid}
        request = http.build_request(
            "POST", out.replica.url + path, json=self._body(spec), headers=headers
        )
        response = await http.send(request, stream=True)
        try:
            out.status, out.answered = response.status_code, time.monotonic()
            if response.status_code != 200:
                out.code, out.message = _error(await response.aread())
            elif spec.stream:
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        out.completed = True
            else:
                out.completed = "choices" in json.loads(await response.aread())
        finally:
            await response.aclose()

    async def _sdk(self, out: Outcome) -> None:
        spec = out.spec
        client = self._sdk_client(out.replica.url, spec.account)
        options: dict[str, Any] = {
            "model": "m",
            "max_tokens": spec.max_tokens,
            "extra_headers": {"x-request-id": spec.rid},
            "extra_body": {"fail_fast": spec.fail_fast, "service_tier": spec.tier},
        }
        try:
            if spec.chat:
                messages: Any = [{"role": "user", "content": "chaos"}]
                raw: Any = await client.chat.completions.with_raw_response.create(
                    messages=messages, **options
                )
            else:
                raw = await client.completions.with_raw_response.create(prompt="chaos", **options)
        except openai.APIStatusError as exc:
            out.status, out.answered = exc.status_code, time.monotonic()
            out.code = str(getattr(exc, "code", "") or "")
            out.message = str(getattr(exc, "message", "") or "")
            return
        out.status, out.answered = raw.status_code, time.monotonic()
        out.completed = bool(raw.parse().choices)

    def _sdk_client(self, url: str, account: str) -> openai.AsyncOpenAI:
        client = self._sdks.get((url, account))
        if client is None:
            # openai's own HTTP client (httpx2, a fork of httpx) takes its own Limits.
            limits = httpx2.Limits(max_connections=8, keepalive_expiry=KEEPALIVE_S)
            client = openai.AsyncOpenAI(
                base_url=url + "/v1",
                api_key=self.keys[account],
                max_retries=0,
                timeout=self.timeout_s,
                http_client=openai.DefaultAsyncHttpxClient(limits=limits),
            )
            self._sdks[(url, account)] = client
        return client


def _error(body: bytes) -> tuple[str, str]:
    """The error's code and message."""
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return "unparsable", body[:200].decode(errors="replace")
    return str(error.get("code") or ""), str(error.get("message") or "")[:200]
