"""One keep-alive HTTP/1.1 connection to a worker: an asyncio Protocol parsed by httptools.

One exchange at a time: `request` writes the request (head and content-length body in one
write) and returns a future resolved when the answer's head has been parsed; `next_chunk`
hands the body over as it arrives, everything received so far in one piece. No task, no
stream reader, no lock: the parser's callbacks (called from `data_received`, in C) resolve
the futures the caller waits on.

Bounds: at most `HIGH_WATER` bytes of body wait for the caller; past that, reading pauses
(the worker's writes back up in TCP) until the caller has taken them. Deadlines: the worker
may be silent at most `read_timeout_s` (time to its head included); one timer per
connection checks the time of the last byte, re-armed only when it fires, not per byte.
Silence while reading is paused (the caller lags) does not count.

Errors are this module's own (`Disconnected`, `Silent`, `NotHttp`); routing/hop/client.py
translates them. A connection whose answer did not end cleanly is never reused.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import cast

import httptools

# The answer's head (status line and headers, trailers too) at most; aiohttp took about as
# much. Past it the answer is not HTTP the gateway accepts, and the worker cannot make this
# process hold more.
MAX_HEAD_BYTES = 64 * 1024
# Body bytes held for a caller that lags before reading pauses; it resumes once they are taken.
HIGH_WATER = 256 * 1024


class Disconnected(ConnectionError):
    """The worker closed or reset the connection before its answer ended. `answered`: any
    byte of the answer had arrived (else the worker may not have seen the request)."""

    def __init__(self, message: str, *, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


class Silent(TimeoutError):
    """The worker sent nothing for longer than the read timeout."""


class NotHttp(Exception):
    """What the worker sent is not an HTTP/1.1 answer."""


class Connection(asyncio.Protocol):
    """A connection, idle or carrying one exchange. `on_gone` is called once when it closes."""

    def __init__(self, read_timeout_s: float, on_gone: Callable[[Connection], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._read_timeout = read_timeout_s
        self._on_gone = on_gone
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False  # it has carried a whole exchange before this one
        self.idle_since = 0.0
        self._busy = False
        self._answered = False
        self._head_bytes = 0
        self._head: asyncio.Future[int] | None = None
        self.headers: dict[str, str] = {}
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self.complete = False
        self._keep = False
        self._delimited = False  # the body's end is marked (content-length or chunked)
        self._error: BaseException | None = None
        self._paused = False
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # --- the caller's side ------------------------------------------------------------------

    def request(self, data: bytes) -> asyncio.Future[int]:
        """Send `data` (a whole request); the future gets the answer's status once its head
        has arrived, or one of this module's errors."""
        loop = self._loop
        self._busy, self._answered, self.complete, self._keep = True, False, False, False
        self._error, self._buffered, self._head_bytes, self.headers = None, 0, 0, {}
        self._chunks.clear()
        head: asyncio.Future[int] = loop.create_future()
        self._head = head
        transport = self._transport
        if self.closed or transport is None:
            head.set_exception(Disconnected("connection closed", answered=False))
            return head
        self._last = loop.time()
        if self._timer is None:
            self._timer = loop.call_at(self._last + self._read_timeout, self._check_silence)
        transport.write(data)
        return head

    async def next_chunk(self) -> bytes | None:
        """The body received so far and not yet taken (waiting for some if none); None at
        its end. Raises this module's errors once what arrived before them is taken."""
        chunks = self._chunks
        while not chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return None
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self._transport is not None and not self.closed:
            self._paused = False
            self._last = self._loop.time()  # the silence so far was the caller's
            self._transport.resume_reading()
        return chunk

    @property
    def reusable(self) -> bool:
        """The last answer ended cleanly and the worker keeps the connection open."""
        return self.complete and self._keep and not self.closed and self._error is None

    def finish(self) -> None:
        """The exchange is over (its answer taken or dropped); the connection is idle."""
        self._busy = False
        self._head = None
        self.reused = True
        self.idle_since = self._loop.time()

    def close(self) -> None:
        """Drop the connection now, whatever is in flight (a worker sees the request
        cancelled: vLLM aborts it and frees its KV cache)."""
        if self._transport is not None and not self.closed:
            self._transport.abort()
        self._gone()

    # --- the transport's side ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but they act alike.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            self._fail(NotHttp("bytes from the worker on an idle connection"))
            return
        self._answered = True
        self._last = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(NotHttp("the worker switched protocols"))
            return
        except httptools.HttpParserError as exc:
            inner = exc.__context__  # our own callback's refusal, else the parser's
            self._fail(inner if isinstance(inner, NotHttp) else NotHttp(f"unparsable: {exc}"))
            return
        head = self._head
        if head is not None and not head.done():  # httptools buffers a partial header
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._fail(NotHttp("the answer's head is too large"))

    def eof_received(self) -> bool:
        if self._busy and not self.complete and self._error is None:
            if self._head is not None and self._head.done() and not self._delimited:
                self._end(keep=False)  # a body delimited by the connection's end
            else:
                self._fail(Disconnected("closed by the worker", answered=self._answered))
        self._gone()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self._busy and not self.complete and self._error is None:
            reason = "closed by the worker" if exc is None else f"lost: {exc}"
            self._fail(Disconnected(reason, answered=self._answered))
        self._gone()

    def pause_writing(self) -> None:  # a request body is bounded: the transport buffers it
        pass

    def resume_writing(self) -> None:
        pass

    # --- httptools' callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:  # many complete headers (or trailers)
            raise NotHttp("the answer's head is too large")  # feed_data raises it wrapped
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        headers = self.headers
        self._delimited = "content-length" in headers or "transfer-encoding" in headers
        head = self._head
        if head is not None and not head.done():
            head.set_result(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        self._wake()
        if self._buffered > HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    def on_message_complete(self) -> None:
        self._end(keep=self._parser.should_keep_alive())

    # --- inside -----------------------------------------------------------------------------

    def _end(self, keep: bool) -> None:
        self.complete = True
        self._keep = keep
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            head = self._head
            if head is not None and not head.done():
                head.set_exception(error)
                head.exception()  # retrieved: a caller gone meanwhile leaves no warning
            self._wake()
        if self._transport is not None and not self.closed:
            self._transport.abort()
        self._gone()

    def _gone(self) -> None:
        if not self.closed:
            self.closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._on_gone(self)

    def _check_silence(self) -> None:
        """The read timer: fails a worker silent for too long, else sets itself again for
        the latest deadline (idle connections have none: it stops)."""
        self._timer = None
        if not self._busy or self.complete or self.closed:
            return
        now = self._loop.time()
        if self._paused:
            self._last = now  # the caller lags; the worker is not silent
        elif now >= self._last + self._read_timeout:
            self._fail(Silent(f"no byte from the worker for {self._read_timeout:g} s"))
            return
        self._timer = self._loop.call_at(self._last + self._read_timeout, self._check_silence)
