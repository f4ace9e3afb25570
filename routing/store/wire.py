"""The wire under routing/store/resp.py: RESP encoding of commands (and of transactions), Redis
error replies as redis-py's exception types, and the TCP keepalive every Redis connection
uses."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import hiredis
from redis.exceptions import NoScriptError, ResponseError

Command = Sequence[Any]


class Transaction(tuple[Command, ...]):
    """Commands Redis runs all or none (MULTI ... EXEC), sent as one command of a batch:
    one reply, EXEC's list, or the first error of the block (a command refused while
    queued, e.g. OOM or MOVED, aborts the whole block: nothing ran). Cheaper than a script
    for commands with many arguments: a script's redis.call converts every argument anew
    (a 23-field XADD costs Redis about twice as much from Lua as sent directly)."""

    __slots__ = ()

    def replies(self) -> int:
        return len(self) + 2


def unfolded(command: Command) -> Sequence[Command]:
    """The commands as Redis sees them: a transaction's MULTI, its commands and EXEC."""
    if isinstance(command, Transaction):
        return [("MULTI",), *command, ("EXEC",)]
    return [command]


def replies_of(commands: Sequence[Command]) -> int:
    """How many replies Redis sends for the commands (a transaction's MULTI, QUEUED... and
    EXEC each answer)."""
    return sum(c.replies() if isinstance(c, Transaction) else 1 for c in commands)


def fold(commands: Sequence[Command], replies: list[Any]) -> list[Any]:
    """One reply per command again: a transaction's replies become one (see `Transaction`)."""
    folded: list[Any] = []
    at = 0
    for command in commands:
        if not isinstance(command, Transaction):
            folded.append(replies[at])
            at += 1
            continue
        block = replies[at : at + command.replies()]
        at += command.replies()
        exec_reply = block[-1]
        if isinstance(exec_reply, list):
            exec_reply = [reply_error(r) if isinstance(r, hiredis.ReplyError) else r
                          for r in exec_reply]  # fmt: skip
            block[-1] = exec_reply
        error = next((r for r in _flat(block) if isinstance(r, Exception)), None)
        folded.append(error if error is not None else exec_reply)
    return folded


def _flat(block: list[Any]) -> list[Any]:
    last = block[-1]
    return [*block[:-1], *(last if isinstance(last, list) else [last])]


# Probe an idle connection after 10 s, every 5 s, give up after 3 misses: a Redis host that
# vanished (no FIN, no RST) is noticed in about 25 s even on a connection with no calls.
KEEPALIVE = (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))


def keepalive_options() -> dict[int, int]:
    """TCP keepalive timings this platform knows, as redis-py's `socket_keepalive_options`."""
    return {getattr(socket, n): v for n, v in KEEPALIVE if hasattr(socket, n)}


def set_keepalive(sock: Any) -> None:
    """Keepalive on a TCP socket (a stdlib socket, or uvloop's socket-like object)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in keepalive_options().items():
        sock.setsockopt(socket.IPPROTO_TCP, option, value)


_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
_EXEC = b"*1\r\n$4\r\nEXEC\r\n"


def pack(commands: Sequence[Command]) -> bytes:
    """RESP encoding of several commands, ready for one write: hiredis's encoder for a tuple
    of str, int, float and bytes (in C, 3x cheaper than the loop below for a usage record's
    XADD), the same bytes from `_pack_args` for anything else."""
    out: list[bytes] = []
    for command in commands:
        if isinstance(command, Transaction):
            out.append(_MULTI)
            out.append(pack(command))
            out.append(_EXEC)
            continue
        try:
            args = command if command.__class__ is tuple else tuple(command)
            out.append(_pack_command(args))
        except TypeError:  # an argument of another type (bool, None...)
            out.append(_pack_args(command))
    return b"".join(out)


_pack_command = hiredis.pack_command


def _pack_args(command: Command) -> bytes:
    out = [b"*%d\r\n" % len(command)]
    for arg in command:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, float):
            data = repr(arg).encode()
        else:
            data = str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def reply_error(reply: hiredis.ReplyError) -> ResponseError:
    message = str(reply)
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    return ResponseError(message)


def text(value: Any) -> str:
    """A reply's bytes as text (UTF-8); None as the empty string."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return "" if value is None else str(value)
