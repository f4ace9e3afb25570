"""The hop's settings (`upstream:` in the config), and the aiohttp client the hop used
before routing/hopclient.py.

The gateway posts to workers through routing/hopclient.py (pooled HTTP/1.1 on httptools),
which measured a quarter less gateway CPU per request (bench/README.md). `Upstream`
stays as the reference its error translation was built against (tests/routing/
test_upstream.py pins it) and as the other side of that measurement; nothing in the
gateway builds it. aiohttp rather than httpx here because it measured 4-8x cheaper in CPU
per proxied request. Its errors never leave this module: they become routing/errors.py
`Worker*` exceptions, which the gateway translates into its answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

from routing.errors import WorkerBrokeOff, WorkerFailed, WorkerTimeout, WorkerUnreachable


class UpstreamSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    connect_timeout_s: float = Field(5.0, gt=0)
    # Longest silence allowed between two bytes of a worker's answer (time to first token
    # of a long prompt included), not a cap on the whole generation.
    read_timeout_s: float = Field(600.0, gt=0)
    # Largest non-streamed answer accepted from a worker.
    max_response_bytes: int = Field(64 * 1024 * 1024, ge=1024)


class UpstreamResponse:
    """A worker's answer whose headers have arrived; the body is read or streamed once."""

    __slots__ = ("_max_bytes", "_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse, max_bytes: int) -> None:
        self._resp = resp
        self._max_bytes = max_bytes
        self.status = resp.status
        self.headers: Mapping[str, str] = resp.headers

    async def read(self) -> bytes:
        """The whole body (bounded), then the connection goes back to the pool."""
        try:
            body = bytearray()
            async for chunk in self._resp.content.iter_any():
                body += chunk
                if len(body) > self._max_bytes:
                    raise WorkerFailed("The worker's answer is too large.")
            return bytes(body)
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise WorkerTimeout("The worker stopped answering.") from exc
        except aiohttp.ClientError as exc:
            raise WorkerBrokeOff("The worker's answer broke off.") from exc
        finally:
            self._resp.release()

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive from the worker."""
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise WorkerTimeout("The worker stopped answering mid-stream.") from exc
        except aiohttp.ClientError as exc:
            raise WorkerBrokeOff("The worker's stream broke off.") from exc

    def close(self) -> None:
        """Drop the connection: a worker like vLLM aborts the request and frees its KV cache."""
        self._resp.close()

    def release(self) -> None:
        self._resp.release()


KEEPALIVE_S = 4.0


class Upstream:
    """Posts JSON to workers over one pooled session. Build in the lifespan, close on exit."""

    def __init__(self, settings: UpstreamSettings, max_connections: int) -> None:
        self._settings = settings
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections,
            limit_per_host=0,
            ttl_dns_cache=300,
            # Idle connections are dropped before the worker drops them: uvicorn, and so vLLM
            # and SGLang, close theirs after 5 s; a request sent on one just as it closes fails
            # as "unreachable" and takes a healthy endpoint out of rotation.
            keepalive_timeout=KEEPALIVE_S,
            enable_cleanup_closed=False,
        )
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self._settings.connect_timeout_s,
            sock_read=self._settings.read_timeout_s,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=True,
            skip_auto_headers=("User-Agent",),
        )

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The pooled session once started; the health probes share it."""
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        session = self._session
        if session is None:
            raise RuntimeError("Upstream.start() was not called")
        try:
            resp = await session.post(url, data=body, headers=headers)
        except aiohttp.ConnectionTimeoutError as exc:
            raise WorkerUnreachable("The worker could not be reached in time.") from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise WorkerTimeout("The worker did not answer in time.") from exc
        except (aiohttp.ClientConnectionError, OSError) as exc:
            raise WorkerUnreachable("The worker could not be reached.") from exc
        except aiohttp.ClientError as exc:
            raise WorkerFailed("The worker answered garbage.") from exc
        return UpstreamResponse(resp, self._settings.max_response_bytes)
