"""The listen socket, bound before any server starts.

A busy port is then one clear line before any app, store connection or simulated worker
has started (uvicorn would log a traceback and leave the other servers of a loop running),
and a server only says it is serving once its port is its own.
"""

from __future__ import annotations

import errno
import socket


class ListenError(Exception):
    """The port could not be had; the message is the one line an operator needs."""


def listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A socket bound to host:port (port 0: a free one), for `serve` and `serve_together`.
    With `reuse_port`, other sockets of this user with the same option may bind the same
    port, and the kernel spreads new connections over those listening (gateway/edge/workers.py)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn does: a restart may take the port while old connections linger.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(f"port {port} on {host} is in use") from None
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock
