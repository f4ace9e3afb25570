"""What uvicorn's httptools protocol gets wrong for two kinds of clients, put right for
gateway/edge/protocol.py.

- **`Upgrade: h2c`** (curl `--http2`, Java's HttpClient by default, on `http://`): httptools
  ends any request that asks for an upgrade at its headers, and uvicorn, which serves only
  websocket upgrades, then runs it with an empty body (every POST answered 422). RFC 9113
  3.1 lets a server ignore the upgrade and answer in HTTP/1.1: `IgnoredUpgrade` reads the
  body the parser skipped (by its `content-length`) into the request, and the connection
  closes after the answer (the parser is spent past an upgrade).
- **HTTP/1.0** has no chunked coding, which uvicorn uses for every answer without a
  `content-length` (a stream): `Http10Cycle` sends such a body as it is, ended by closing
  the connection (RFC 9112 6.3).
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

# A close-delimited body has no length: uvicorn's count of what is left never runs out.
_UNBOUNDED = 1 << 62


class IgnoredUpgrade:
    """The body of one request whose upgrade was ignored, fed to its cycle as it arrives."""

    __slots__ = ("_cycle", "_flow", "_left")

    def __init__(self, cycle: RequestResponseCycle, flow: FlowControl, length: int) -> None:
        self._cycle = cycle
        self._flow = flow
        self._left = length

    @classmethod
    def begin(
        cls, cycle: RequestResponseCycle, headers: list[tuple[bytes, bytes]], flow: FlowControl
    ) -> IgnoredUpgrade | None:
        """Its body's reader; None when it cannot be read (a chunked one: refused)."""
        length = 0
        for name, value in headers:
            if name == b"transfer-encoding":
                return None
            if name == b"content-length":
                length = int(value) if value.strip().isdigit() else 0
        cycle.keep_alive = False
        cycle.more_body = length > 0
        return cls(cycle, flow, length)

    def feed(self, data: bytes) -> None:
        """Bytes of the body (past it: nothing more is read on this connection)."""
        cycle = self._cycle
        if self._left <= 0 or cycle.response_complete or not data:
            return
        taken = data[: self._left]
        self._left -= len(taken)
        cycle.body += taken
        if self._left == 0:
            cycle.more_body = False
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self._flow.pause_reading()
        cycle.message_event.set()


def close_delimited(cycle: RequestResponseCycle) -> None:
    """The answer begun on `cycle` is sent as it is and ended by closing the connection."""
    cycle.chunked_encoding = False
    cycle.expected_content_length = _UNBOUNDED
    cycle.keep_alive = False
    cycle.__dict__["_close_delimited"] = True


class Http10Cycle(RequestResponseCycle):
    """A request cycle of HTTP/1.0: an answer without `content-length` is close-delimited."""

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            names = {name.lower() for name, _ in message.get("headers", ())}
            if b"content-length" not in names:
                close_delimited(self)
        elif self.__dict__.get("_close_delimited") and not message.get("more_body", False):
            self.expected_content_length = len(message.get("body", b""))  # the last part
        await super().send(message)
