"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol with each answer
in one write, and a callback (no task) for a caller that disconnects mid-request.

uvicorn writes a response's status line and headers as soon as the app sends
`http.response.start`, and the body apart: two `send` syscalls and two TCP segments per
answer, where one does. Here the connection's transport holds a head back until the next
write (the body, in the same loop turn for every answer the gateway sends) and sends both
in one. A head nothing follows in its loop turn (an app that sends its start and then
waits) leaves at the next turn, so nothing waits longer than that. Order is kept: any
other write, a close or an EOF sends a held head first.

A request that must stop when its caller disconnects used to keep a task waiting on ASGI
`receive` for `http.disconnect`; on this protocol `on_disconnect` registers a callback
that the lost connection calls instead (uvicorn's own signal: the request's cycle marked
disconnected), which spares a task per request. On any other server it answers False and
the caller waits on `receive` as before. Both measured in bench/README.md.

A whole answer (status, headers and a body known in full: every non-streamed answer of the
hot routes) goes out through `write_answer`: one bytes join and one write, with the
request cycle's bookkeeping done as its ASGI `send` would, instead of two `send` messages
(a head held back, then joined). Measured in bench/README.md. A stream's head and first
event go out alike through `write_stream_start` (its later events through `send`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from gateway.edge.oldclients import Http10Cycle, IgnoredUpgrade, close_delimited

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

    def write_whole(self, data: bytes) -> None:
        """A whole answer: after any held head, never held itself."""
        if self._head is not None:
            self.flush()
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


# The attribute of a uvicorn request cycle holding its disconnect callback.
_ON_LOST = "_gateway_on_lost"


class GatewayProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a `HeadJoiningTransport`, calling the current
    request's `on_disconnect` callback when the connection is lost before its answer."""

    # The body of a request whose `Upgrade: h2c` was ignored (gateway/edge/oldclients.py).
    _ignored: IgnoredUpgrade | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        loop = asyncio.get_running_loop()
        wrapped = HeadJoiningTransport(transport, loop)  # type: ignore[arg-type]
        super().connection_made(wrapped)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        """uvicorn's, but for an upgrade it does not serve (h2c: curl --http2, Java's
        HttpClient): ignored, as RFC 9113 asks, and the request served as HTTP/1.1 with
        its body (httptools stops at the headers of any upgrade request)."""
        if self._ignored is not None:
            self._ignored.feed(data)
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade as upgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            elif self.cycle is not None and not self.cycle.response_complete:
                self._ignored = IgnoredUpgrade.begin(self.cycle, self.headers, self.flow)
                if self._ignored is None:  # its app, not begun yet, sees its caller gone
                    self.cycle.disconnected = True
                    self.send_400_response("A chunked body beside an Upgrade header.")
                else:
                    self._ignored.feed(data[upgrade.args[0] :])

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope and self.scope["http_version"] == "1.0":
            cycle.__class__ = Http10Cycle  # no chunked coding: a stream's end is the close

    # uvicorn arms a keep-alive timer after every answer and cancels it when the next request
    # begins: a timer made and dropped per request. Here one timer per idle spell checks,
    # when it fires, how long the connection has been idle, and waits for the rest.
    _idle_since: float | None = None

    def _unset_keepalive_if_required(self) -> None:
        self._idle_since = None  # a request begins (or the connection ends): not idle

    def on_response_complete(self) -> None:
        # uvicorn's, but for the keep-alive timer (above).
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._idle_since = None
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self._keep_alive_due
            )

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        idle_since = self._idle_since
        if idle_since is None:  # busy: the answer's end arms it again
            return
        left = idle_since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_due)
        else:
            self.timeout_keep_alive_handler()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:
            callback = cycle.__dict__.pop(_ON_LOST, None)
            if callback is not None:
                callback()


def on_disconnect(receive: Callable[..., Any], callback: Callable[[], None]) -> bool:
    """Have `callback` called once if the caller of the request whose ASGI `receive` this
    is disconnects before its answer is complete (at once if it has already). False when
    the request is not served by `GatewayProtocol`: then nothing is registered."""
    cycle = getattr(receive, "__self__", None)
    if not isinstance(cycle, RequestResponseCycle) or not isinstance(
        cycle.transport, HeadJoiningTransport
    ):
        return False
    if cycle.disconnected:
        callback()
    else:
        setattr(cycle, _ON_LOST, callback)
    return True


def forget_disconnect(receive: Callable[..., Any]) -> None:
    """The request is over: its callback, if still registered, is dropped."""
    cycle = getattr(receive, "__self__", None)
    if cycle is not None:
        cycle.__dict__.pop(_ON_LOST, None)


async def write_answer(
    send: Callable[..., Any], status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> bool:
    """Send a whole answer (`content-length` added here) in one write on the request cycle
    whose ASGI `send` this is, as that `send` would with a start and a body message. False
    when it cannot (another server, an answer already begun, a HEAD, uvicorn's access log
    on): nothing is sent then and the caller sends the two messages."""
    begun = await _begin(send, status, headers)
    if begun is None:
        return False
    cycle, transport, parts = begun
    if parts is None:
        return True  # as uvicorn's send: an answer to no one is dropped
    parts += (b"content-length: %d\r\n\r\n" % len(body), body)
    transport.write_whole(b"".join(parts))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()
    return True


async def write_stream_start(
    send: Callable[..., Any], status: int, headers: list[tuple[bytes, bytes]], first: bytes
) -> bool:
    """Begin a chunked answer (a stream) with its first part in one write, as the ASGI
    `send` would with a start message and a body message of `first` with more to come; the
    rest goes through `send` as usual. False when it cannot (as `write_answer`): nothing is
    sent then. An empty `first` sends the head alone, held until the next write."""
    begun = await _begin(send, status, headers)
    if begun is None:
        return False
    cycle, transport, parts = begun
    if parts is None:
        return True
    if cycle.scope["http_version"] == "1.0":  # HTTP/1.0 has no chunked coding
        close_delimited(cycle)
        parts.append(b"\r\n")
        transport.write_whole(b"".join((*parts, first)))
        return True
    cycle.chunked_encoding = True
    parts.append(b"transfer-encoding: chunked\r\n\r\n")
    if first:
        parts += (b"%x\r\n" % len(first), first, b"\r\n")
        transport.write_whole(b"".join(parts))
    else:
        transport.write(b"".join(parts))
    return True


async def _begin(
    send: Callable[..., Any], status: int, headers: list[tuple[bytes, bytes]]
) -> tuple[RequestResponseCycle, HeadJoiningTransport, list[bytes] | None] | None:
    """The request cycle whose `send` this is, its transport and the head's parts (None when
    the caller is gone); None when the answer cannot be written here."""
    cycle = getattr(send, "__self__", None)
    if not isinstance(cycle, RequestResponseCycle):
        return None
    transport = cycle.transport
    if (
        not isinstance(transport, HeadJoiningTransport)
        or cycle.response_started
        or cycle.access_log
        or cycle.scope["method"] == "HEAD"
    ):
        return None
    return cycle, transport, await _head(cycle, status, headers)


async def _head(
    cycle: RequestResponseCycle, status: int, headers: list[tuple[bytes, bytes]]
) -> list[bytes] | None:
    """The head's parts but its framing header and blank line, the cycle marked started;
    None (nothing marked) when the caller is gone. Headers are checked before anything."""
    parts = [STATUS_LINE[status]]
    for name, value in (*cycle.default_headers, *headers):
        if (name not in _GOOD_NAMES and not _good_name(name)) or HEADER_VALUE_RE.search(value):
            raise RuntimeError("Invalid HTTP header.")  # before anything is sent or marked
        parts += (name, b": ", value, b"\r\n")
    if cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()
    if cycle.disconnected:
        return None
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    if not cycle.keep_alive:
        parts.append(b"connection: close\r\n")
    return parts


# Header names `write_answer` found valid: the gateway's own, a handful (bounded all the same).
_GOOD_NAMES: set[bytes] = set()
_MAX_GOOD_NAMES = 256


def _good_name(name: bytes) -> bool:
    if HEADER_RE.search(name):
        return False
    if len(_GOOD_NAMES) < _MAX_GOOD_NAMES:
        _GOOD_NAMES.add(name)
    return True
