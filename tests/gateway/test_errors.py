"""routing's errors as the caller sees them: the one mapping (gateway/errors.py
`from_routing`) from reason to status, envelope and `Retry-After`.

Adding a reason is an edit of its enum (routing/errors.py) and of the tables below.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import orjson
import pytest

import routing.errors
from gateway.edge.asgi import error_parts
from gateway.errors import (
    GatewayError,
    ModelNotFound,
    RateLimited,
    ServiceUnavailable,
    UpstreamBroken,
    UpstreamFailed,
    UpstreamTimeout,
    UpstreamUnavailable,
    from_routing,
)
from routing.errors import (
    Limited,
    LimitReason,
    Preempted,
    RoutingError,
    TooLarge,
    Unavailable,
    UnavailableReason,
    UnknownModel,
    WorkerBrokeOff,
    WorkerFailed,
    WorkerTimeout,
    WorkerUnreachable,
)

# The contract (docs/api.md): every 429 code, and the code each 503 reason shows.
LIMIT_CODES = {
    LimitReason.MODEL_BUSY: "model_busy",
    LimitReason.FLEX_NO_CAPACITY: "flex_no_capacity",
    LimitReason.QUEUE_FULL: "queue_full",
    LimitReason.QUEUE_TIMEOUT: "queue_timeout",
    LimitReason.CONCURRENCY_LIMIT: "concurrency_limit",
    LimitReason.RATE_LIMIT_REQUESTS: "rate_limit_requests",
    LimitReason.RATE_LIMIT_TOKENS: "rate_limit_tokens",
    LimitReason.DEADLINE_UNREACHABLE: "deadline_unreachable",
    LimitReason.PREEMPTED: "preempted",
}
UNAVAILABLE_CODES = {
    UnavailableReason.NO_HEALTHY_ENDPOINT: "service_unavailable",
    UnavailableReason.STORE_UNREACHABLE: "service_unavailable",
    UnavailableReason.NO_LOCAL_SHARE: "service_unavailable",
    UnavailableReason.KEY_STORE_UNREACHABLE: "service_unavailable",
    UnavailableReason.NO_KNOWN_ENDPOINT: "service_unavailable",
    UnavailableReason.SHUTTING_DOWN: "shutting_down",
}
# Worker failures: (gateway class, whose name is the upstream_errors `kind`; status; code).
WORKER = {
    WorkerFailed: (UpstreamFailed, 502, "upstream_error"),
    WorkerUnreachable: (UpstreamUnavailable, 502, "upstream_unavailable"),
    WorkerBrokeOff: (UpstreamBroken, 502, "upstream_stream_broken"),
    WorkerTimeout: (UpstreamTimeout, 504, "upstream_timeout"),
}


def answer(exc: RoutingError) -> tuple[int, dict[str, object], dict[bytes, bytes]]:
    status, body, headers = error_parts(from_routing(exc), "rid")
    return status, orjson.loads(body), dict(headers)


def test_the_tables_name_every_reason() -> None:
    assert set(LIMIT_CODES) == set(LimitReason)
    assert set(UNAVAILABLE_CODES) == set(UnavailableReason)


def test_docs_api_lists_every_429_code_and_no_other() -> None:
    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text(encoding="utf-8")
    rows = api.split("| 429 `code` |")[1].split("\n\n")[0]  # the table ends at a blank line
    assert re.findall(r"^\| `([a-z_]+)` \|", rows, re.M) == list(LIMIT_CODES.values())


@pytest.mark.parametrize("reason", list(LimitReason))
def test_a_limit_is_a_429_with_its_reason_as_code_and_retry_after(reason: LimitReason) -> None:
    status, body, headers = answer(Limited("No slot.", reason, retry_after_s=7))
    assert status == 429
    assert body == {
        "error": {
            "message": "No slot.",
            "type": "rate_limit_error",
            "param": None,
            "code": LIMIT_CODES[reason],
        }
    }
    assert headers[b"retry-after"] == b"7"
    assert b"x-should-retry" not in headers


def test_a_limit_no_retry_can_fix_tells_the_sdk_not_to_retry() -> None:
    status, _, headers = answer(
        Limited("Too large.", LimitReason.RATE_LIMIT_TOKENS, 60, retryable=False)
    )
    assert (status, headers[b"retry-after"], headers[b"x-should-retry"]) == (429, b"60", b"false")


def test_the_body_is_the_envelope_byte_for_byte() -> None:
    _, body, _ = error_parts(from_routing(Limited("m", LimitReason.QUEUE_FULL, 3)), "r")
    expected = (
        b'{"error":{"message":"m","type":"rate_limit_error","param":null,"code":"queue_full"}}'
    )
    assert body == expected


def test_a_retry_estimate_below_one_second_says_one() -> None:
    error = from_routing(Limited("x", LimitReason.MODEL_BUSY, retry_after_s=0))
    assert isinstance(error, RateLimited)
    assert (error.retry_after_s, error.headers) == (1, {"retry-after": "1"})


def test_the_code_is_a_plain_string() -> None:
    """What goes into the envelope and the `reason` metric label is the bare value."""
    error = from_routing(Limited("x", LimitReason.QUEUE_TIMEOUT, 2))
    assert type(error.code) is str and error.code == "queue_timeout"


@pytest.mark.parametrize("reason", list(UnavailableReason))
def test_unavailable_is_a_503_without_retry_after(reason: UnavailableReason) -> None:
    status, body, headers = answer(Unavailable("Down.", reason))
    assert status == 503
    assert body == {
        "error": {
            "message": "Down.",
            "type": "api_error",
            "param": None,
            "code": UNAVAILABLE_CODES[reason],
        }
    }
    assert b"retry-after" not in headers


def test_the_gateway_s_own_503_shows_the_same_codes() -> None:
    for reason, code in UNAVAILABLE_CODES.items():
        error = ServiceUnavailable("x", reason=reason)
        assert (error.status, error.code, error.reason, error.headers) == (503, code, reason, {})


def test_an_unknown_model_is_a_404_naming_the_model_param() -> None:
    status, body, headers = answer(UnknownModel("The model 'x' does not exist."))
    assert status == 404
    assert body == {
        "error": {
            "message": "The model 'x' does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert headers[b"x-should-retry"] == b"false"
    assert isinstance(from_routing(UnknownModel("x")), ModelNotFound)


@pytest.mark.parametrize("kind", list(WORKER), ids=lambda k: k.__name__)
def test_worker_failures_keep_their_status_code_and_kind(kind: type[RoutingError]) -> None:
    cls, status, code = WORKER[kind]
    error = from_routing(kind("The worker failed."))
    assert type(error) is cls  # its name is the `kind` label of gateway_upstream_errors
    assert (error.status, error.code, error.type, error.headers) == (status, code, "api_error", {})
    assert error.message == "The worker failed."


def test_every_routing_error_is_mapped() -> None:
    raised = [
        cls
        for _, cls in inspect.getmembers(routing.errors, inspect.isclass)
        if issubclass(cls, RoutingError) and cls is not RoutingError
    ]
    for cls in raised:
        if cls is Limited:
            exc: RoutingError = Limited("x", LimitReason.MODEL_BUSY, 1)
        elif cls is Unavailable:
            exc = Unavailable("x", UnavailableReason.SHUTTING_DOWN)
        elif cls is TooLarge:
            exc = TooLarge("x", 10, 5)
        elif cls is Preempted:
            exc = Preempted("x", 3)
        else:
            exc = cls("x")
        assert isinstance(from_routing(exc), GatewayError), cls


def test_a_request_no_endpoint_could_hold_is_a_400_never_retried() -> None:
    error = from_routing(TooLarge("needs 9000 tokens, the largest holds 4096", 9000, 4096))
    assert (error.status, error.code, error.type, error.param) == (
        400, "context_too_large", "invalid_request_error", "max_tokens"
    )  # fmt: skip
    assert error.headers == {"x-should-retry": "false"}


def test_a_new_kind_of_worker_failure_answers_as_its_parent() -> None:
    class WorkerVanished(WorkerUnreachable):
        pass

    assert type(from_routing(WorkerVanished("x"))) is type(from_routing(WorkerUnreachable("x")))


@pytest.mark.parametrize(
    "exc",
    [
        Limited("x", LimitReason.QUEUE_FULL, 2),
        Unavailable("x", UnavailableReason.NO_HEALTHY_ENDPOINT),
        WorkerTimeout("x"),
    ],
)
def test_the_model_the_error_concerns_is_kept(exc: RoutingError) -> None:
    exc.model = "m1"
    assert from_routing(exc).model == "m1"


# --- the Lua scripts ---------------------------------------------------------------------------

LUA = Path(routing.errors.__file__).parent / "store" / "lua"
# A reason mentioned in Lua: a quoted or backticked snake_case word.
TOKEN = re.compile(r"""[`'"]([a-z]+(?:_[a-z]+)+)[`'"]""")


def test_the_reasons_lua_mentions_are_members_of_the_enums() -> None:
    """Lua answers with statuses (routing/admission/slots.py); where it names a reason, in a reply
    or a comment, the name is one of the enums'. Reason-shaped: ends like one of them."""
    reasons = {str(r) for r in [*LimitReason, *UnavailableReason]}
    endings = {r.rsplit("_", 1)[1] for r in reasons if "_" in r}  # (TOKEN: two words or more)
    named = {
        token
        for script in LUA.glob("*.lua")
        for token in TOKEN.findall(script.read_text(encoding="utf-8"))
        if token.rsplit("_", 1)[1] in endings
    }
    assert "queue_full" in named  # acquire.lua's mention: the scan finds what it looks for
    assert named <= reasons, named - reasons
