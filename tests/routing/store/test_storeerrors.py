"""Store errors name their cause, once a minute (failing background loops back off:
tests/routing/test_background_backoff.py).
(The same causes against real misconfigured servers: tests/e2e/test_store_causes.py.)"""

from __future__ import annotations

import logging

import pytest
from redis.exceptions import (
    AuthenticationError,
    MaxConnectionsError,
    NoPermissionError,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from routing.background import BackgroundErrors
from routing.store.causes import REFUSAL_MEMORY_S, StoreErrors, cause_of
from routing.store.resp import NotSent

WRONGPASS = "redis: WRONGPASS invalid username-password pair or user is disabled."


def _wrapped(inner: BaseException) -> NotSent:
    try:
        raise NotSent(str(inner)) from inner  # as the RESP client does while connecting
    except NotSent as exc:
        return exc


@pytest.mark.parametrize(
    ("exc", "kind", "text"),
    [
        # redis-py strips Redis's error codes; the RESP client keeps them.
        (AuthenticationError("invalid username-password pair or user is disabled."),
         "auth", WRONGPASS),
        (_wrapped(ResponseError("WRONGPASS invalid username-password pair or user is disabled.")),
         "auth", WRONGPASS),
        (ResponseError("NOAUTH Authentication required."),
         "auth", "redis: NOAUTH Authentication required."),
        (AuthenticationError("Authentication required."),
         "auth", "redis: NOAUTH Authentication required."),
        (NoPermissionError("this user has no permissions to run the 'evalsha' command"),
         "permission", "redis: NOPERM this user has no permissions to run the 'evalsha' command"),
        (ResponseError("NOPERM this user has no permissions to run the 'xadd' command"),
         "permission", "redis: NOPERM this user has no permissions to run the 'xadd' command"),
        (ResponseError("The user executing the script can't run this command or subcommand "
                       "script: 5a91, on @user_script:1."),
         "permission", "redis: NOPERM The user executing the script can't run this command or "
                       "subcommand script: 5a91, on @user_script:1."),
        (ReadOnlyError("You can't write against a read only replica."),
         "not_master", "redis: not a master (replica: READONLY You can't write against a read "
                       "only replica.)"),
        (ResponseError("unknown command 'EVALSHA', with args beginning with: 'secret' '0' "),
         "not_master", "redis: not a master (it refuses EVALSHA: a Sentinel?)"),
        (RedisConnectionError("Error 1 connecting to 127.0.0.1:6380. [SSL: "
                              "CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed "
                              "certificate (_ssl.c:1006)."),
         "tls", "redis: TLS certificate verify failed: self-signed certificate"),
        (MaxConnectionsError("Too many connections"),
         "pool", "redis: no free connection in this process's pool (Too many connections)"),
        (RedisConnectionError("No connection available."),
         "pool", "redis: no free connection in this process's pool (No connection available.)"),
        (RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."),
         "unreachable", "redis: unreachable (Error 111 connecting to 127.0.0.1:1. Connection "
                        "refused.)"),
        (_wrapped(ConnectionRefusedError(111, "Connect call failed")),
         "unreachable", "redis: unreachable ([Errno 111] Connect call failed)"),
        (RedisTimeoutError("Timeout reading from socket"),
         "timeout", "redis: no answer in time (Timeout reading from socket)"),
        (TimeoutError(), "timeout", "redis: no answer in time"),
    ],
)  # fmt: skip
def test_each_error_names_its_cause_in_one_line(exc: BaseException, kind: str, text: str) -> None:
    cause = cause_of(exc)
    assert (cause.kind, cause.text) == (kind, text)
    assert cause.misconfigured == (kind in ("auth", "permission", "tls", "not_master"))
    assert "\n" not in cause.text and "secret" not in cause.text  # no command arguments


def test_a_cause_is_logged_once_a_minute_with_the_count_of_its_repeats(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    errors = StoreErrors(clock=lambda: now[0])
    wrongpass = AuthenticationError("invalid username-password pair or user is disabled.")
    with caplog.at_level(logging.INFO, logger="gateway.store"):
        for i in range(100):
            errors.report(wrongpass, "sweep" if i % 2 else "admission")
            now[0] += 0.5  # fifty seconds of retries
        refused = RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
        errors.report(refused, "sweep")  # another cause: its own line
        now[0] += 11.0
        errors.report(wrongpass, "subscription")  # a minute after the first line
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"{WRONGPASS} (admission)",
        "redis: unreachable (Error 111 connecting to 127.0.0.1:1. Connection refused.) (sweep)",
        f"{WRONGPASS} (subscription; 99 more since the last report, from admission, sweep)",
    ]
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.WARNING, logging.ERROR]


def test_a_misconfiguration_that_refused_a_request_is_remembered_for_a_while() -> None:
    now = [0.0]
    errors = StoreErrors(clock=lambda: now[0])
    errors.report(RedisConnectionError("Connection refused."), "admission", refused=True)
    assert errors.refusal() is None  # an outage: the live probe says so, or it is over
    errors.report(NoPermissionError("no permissions to run the 'xadd' command"), "usage record")
    assert errors.refusal() is None  # no request was refused for it
    errors.report(NoPermissionError("no permissions to run the 'evalsha' command"), "admission",
                  refused=True)  # fmt: skip
    cause = errors.refusal()
    assert cause is not None and "'evalsha'" in cause.text
    now[0] += REFUSAL_MEMORY_S + 1
    assert errors.refusal() is None


def test_store_errors_of_background_tasks_are_reported_by_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    errors = BackgroundErrors(StoreErrors())
    with caplog.at_level(logging.INFO):
        for task in ("sweep", "spool", "subscription"):
            errors.failed(task, ResponseError("NOAUTH Authentication required."))
        errors.failed("health", OSError("not a store task"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "redis: NOAUTH Authentication required. (sweep)"
    assert len(lines) == 2 and "background task health failed" in lines[1]
    assert errors.counts == {"sweep": 1, "spool": 1, "subscription": 1, "health": 1}
