"""The wire under routing/resp.py: RESP encoding of commands, Redis error replies as
redis-py's exception types, and the TCP keepalive every Redis connection uses."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import hiredis
from redis.exceptions import NoScriptError, ResponseError

Command = Sequence[Any]

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


def pack(commands: Sequence[Command]) -> bytes:
    """RESP encoding of several commands, ready for one write."""
    out: list[bytes] = []
    for command in commands:
        out.append(b"*%d\r\n" % len(command))
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
