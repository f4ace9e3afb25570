"""One request's state as it walks through the gateway: what was asked (`Parsed`), and
what happened once it was admitted (`Exchange`, with the `Usage` the worker reported).

Filled by the route (gateway/completions/route.py), the hop (gateway/completions/hop.py) and the
answer rewriting (gateway/completions/answer.py); read for metrics, the access log and the usage
record (gateway/completions/billing.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.completions.streamusage import StreamUsage
from gateway.edge.access import AccessNote
from gateway.edge.body import dumps
from gateway.runtime.auth import Account
from gateway.schemas.common import RoutedRequest
from gateway.schemas.tokens import BYTES_PER_TOKEN, output_tokens, prompt_tokens, sequences
from routing.admission.tokens import TokenAsk
from tiers.policy import Tier


@dataclass(slots=True)
class Parsed:
    """An authenticated, validated request, not yet admitted."""

    rid: str
    started: float
    account: Account
    payload: dict[str, Any]
    request: RoutedRequest
    # The tier asked for (body, else header), before model and key policy apply.
    wanted: Tier
    source: str | None
    # Filled for the access log when it is on (gateway/edge/access.py).
    note: AccessNote | None
    # How long the caller waits (x-request-timeout, gateway/edge/deadline.py): None for
    # as long as its tier's queue timeout.
    deadline_s: float | None = None

    def tokens(self) -> TokenAsk:
        """What it will hold of a worker's KV cache (gateway/schemas/tokens.py): its prompt's
        estimate (its tools' too), its answer's length and how many answers (`n`, for each
        prompt of a batch)."""
        request = self.request
        prompt = prompt_tokens(request) + tools_tokens(self.payload.get("tools"))
        return TokenAsk(prompt, output_tokens(request), sequences(request))


def tools_tokens(tools: Any) -> int:
    """A chat's tools (as the body forwards them): the chat template writes their
    definitions into the prompt, so their bytes count as its text's do."""
    if not tools:
        return 0
    return -(-len(dumps(tools)) // BYTES_PER_TOKEN)


@dataclass(slots=True)
class Usage:
    """The token counts the worker reported (or, for a broken stream, the chunks seen)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    reported: bool = False
    # Token chunks relayed: the completion count when a broken stream never reports usage.
    streamed: int = 0

    def take(self, usage: Any) -> None:
        """A worker's usage: completions' and chat's names, the Responses API's
        (`input_tokens`, `output_tokens`), or an embedding's (its prompt alone)."""
        if not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        embedding = isinstance(prompt, int) and usage.get("total_tokens") == prompt
        if completion is None and "completion_tokens" not in usage and embedding:
            completion = 0  # an embedding: its input is all it used
        if isinstance(prompt, int) and isinstance(completion, int):
            self.prompt_tokens, self.completion_tokens = prompt, completion
            self.reported = True


@dataclass(slots=True)
class Exchange:
    """What happened to one admitted request, for metrics and (later) its usage record."""

    rid: str
    started: float
    stream: bool
    # Where the caller sees a stream's usage (the worker is always asked for it).
    wanted_usage: StreamUsage
    usage: Usage
    status: int = 200
    # Set before the last byte goes out: a disconnect after that is not a cancellation.
    finished: bool = False
    first_byte: float | None = None
    # The caller disconnected (a cancellation then is theirs, not the server's shutdown).
    caller_gone: bool = False
    # A flex request whose slot was taken before its first byte (gateway/completions/
    # preempt.py): its caller got nothing from this admission.
    preempted: bool = False
    # The caller's trace context, checked (gateway/completions/trace.py), for the worker.
    trace: dict[str, str] = field(default_factory=dict)
    # Headers every answer carries once admitted: a rate-limited key's x-ratelimit-*
    # (gateway/ratelimits.py).
    headers: tuple[tuple[bytes, bytes], ...] = ()
