"""The simulated worker's ASGI plumbing (gateway/sim/worker.py): reading the body, noticing a
client that left, the lifespan, and the messages of an answer."""

from __future__ import annotations

import asyncio

import orjson
from starlette.types import Message, Receive, Send

from gateway.edge.asgi import Reply as Answer
from gateway.edge.protocol import forget_disconnect, on_disconnect
from gateway.sim.text import error_body


async def finished_unless_gone(work: asyncio.Future[None], receive: Receive) -> bool:
    """Wait for `work`; if the client disconnects first, cancel it and return False.

    On the gateway's server protocol the lost connection cancels `work` itself, so its slot
    is free before any request that came after the disconnect can ask for one: a gateway
    gives its lease back once it has dropped the connection, and a request it admits then
    must not find the slot still taken here (tests read this worker's peaks). Elsewhere a
    task watching `receive` does it, a few loop turns later."""
    gone = False

    def lost() -> None:
        nonlocal gone
        if not work.done():  # a whole answer reads as a disconnect too (uvicorn's receive)
            gone = True
            work.cancel()

    async def watch() -> None:
        await wait_disconnect(receive)
        lost()

    watcher = None if on_disconnect(receive, lost) else asyncio.ensure_future(watch())
    try:
        await asyncio.wait((work,))  # once cancelled, its `finally` frees the slot first
    finally:
        if watcher is None:
            forget_disconnect(receive)
        else:
            watcher.cancel()
        if not work.done():  # this request itself was cancelled (its server's stop)
            work.cancel()
    if gone:
        return False
    work.result()  # re-raise what it raised (SimulatedCrash)
    return True


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client left before sending it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def response_start(
    status: int, content_type: bytes | None, content_length: int | None = None
) -> Message:
    headers = []
    if content_type is not None:
        headers.append((b"content-type", content_type))
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    return {"type": "http.response.start", "status": status, "headers": headers}


def body_chunk(event: bytes) -> Message:
    return {"type": "http.response.body", "body": event, "more_body": True}


class Tracked(Answer):
    """A request's `send`, remembering how far its answer got (the gateway's own `Reply`)."""

    __slots__ = ()

    async def end(self) -> None:
        """The answer cut short: a 503 if nothing was sent, else the end of its body."""
        if not self.started:
            message = "The simulated worker is shutting down."
            await send_json(self, 503, error_body(503, "ServiceUnavailableError", message))
        elif not self.ended:
            await self({"type": "http.response.body", "body": b"", "more_body": False})


async def send_json(send: Send, status: int, payload: object) -> None:
    body = orjson.dumps(payload)
    await send(response_start(status, b"application/json", len(body)))
    await send({"type": "http.response.body", "body": body})
