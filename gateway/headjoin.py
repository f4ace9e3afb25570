"""One write per answer: uvicorn's httptools protocol, its answers' heads held for their
bodies.

uvicorn writes a response's status line and headers as soon as the app sends
`http.response.start`, and the body apart: two `send` syscalls and two TCP segments per
answer, where one does. Here the connection's transport holds a head back until the next
write (the body, in the same loop turn for every answer the gateway sends) and sends both
in one. A head nothing follows in its loop turn (an app that sends its start and then
waits) leaves at the next turn, so nothing waits longer than that. Order is kept: any
other write, a close or an EOF sends a held head first. Measured in bench/README.md.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# What starts a response head as uvicorn writes it (its STATUS_LINE table); `100 Continue`
# is an interim answer, not a head a body follows, and is never held.
_HEAD = b"HTTP/1.1 "
_CONTINUE = b"HTTP/1.1 100 "
_HEAD_END = b"\r\n\r\n"


class HeadJoiningTransport:
    """A transport's stand-in that holds a response head until the next write."""

    __slots__ = ("_head", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif data.startswith(_HEAD) and data.endswith(_HEAD_END) and not data.startswith(_CONTINUE):
            self._head = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Send a held head now (nothing followed it in its loop turn)."""
        head = self._head
        if head is not None:
            self._head = None
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._head = None
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._head or b"")

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:  # the rest of the transport, as it is
        return getattr(self._transport, name)


class HeadJoiningProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a `HeadJoiningTransport`."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        loop = asyncio.get_running_loop()
        wrapped = HeadJoiningTransport(transport, loop)  # type: ignore[arg-type]
        super().connection_made(wrapped)  # type: ignore[arg-type]
