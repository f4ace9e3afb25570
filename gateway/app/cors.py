"""Cross-origin calls from browser apps (config `cors`, docs/config.md): off by default.

Only a request with an `Origin` header, to a gateway whose config names origins, comes
here. A preflight (`OPTIONS` with `Access-Control-Request-Method`) is answered at once,
without a key: a browser sends none with it. Any other request from an allowed origin is
served as usual, its answer carrying `Access-Control-Allow-Origin` and the headers an app
may read (`expose_headers`); from an origin not allowed it is served without them, which
the browser then hides from the page.
"""

from __future__ import annotations

from gateway.edge.asgi import Message, Scope, Send, request_id, send_error
from gateway.errors import CorsRefused
from gateway.runtime.settings import CorsConfig

_VARY = (b"vary", b"Origin")


def origin_of(scope: Scope) -> bytes | None:
    return _header(scope, b"origin") or None


class Cors:
    """One config's answers to a browser: the preflight, and the headers of the rest."""

    def __init__(self, config: CorsConfig) -> None:
        self._config = config
        self._any = "*" in config.allow_origins
        self._origins = frozenset(o.encode("latin-1") for o in config.allow_origins)
        self._methods = ", ".join(config.allow_methods).encode("latin-1")
        self._expose = ", ".join(config.expose_headers).encode("latin-1")

    def allows(self, origin: bytes) -> bool:
        return self._any or origin.lower() in self._origins

    def _allow_origin(self, origin: bytes) -> list[tuple[bytes, bytes]]:
        if self._any and not self._config.allow_credentials:
            return [(b"access-control-allow-origin", b"*")]
        headers = [(b"access-control-allow-origin", origin), _VARY]
        if self._config.allow_credentials:
            headers.append((b"access-control-allow-credentials", b"true"))
        return headers

    async def preflight(self, scope: Scope, origin: bytes, send: Send) -> None:
        """The answer to a preflight: 204 with what the browser may send, or 403 naming
        what it may not."""
        asked = _header(scope, b"access-control-request-method").decode("latin-1")
        wanted = [h.strip().lower() for h in _header(scope, b"access-control-request-headers")
                  .decode("latin-1").split(",") if h.strip()]  # fmt: skip
        refused = self._refusal(origin, asked, wanted)
        rid = request_id(_header(scope, b"x-request-id").decode("latin-1") or None)
        if refused is not None:
            await send_error(send, CorsRefused(refused), rid)
            return
        headers = [
            *self._allow_origin(origin),
            (b"access-control-allow-methods", self._methods),
            (b"access-control-max-age", str(self._config.max_age_s).encode()),
            (b"x-request-id", rid.encode("latin-1")),
        ]
        if wanted:
            headers.append((b"access-control-allow-headers", ", ".join(wanted).encode()))
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    def _refusal(self, origin: bytes, method: str, headers: list[str]) -> str | None:
        if not self.allows(origin):
            shown = origin[:200].decode("latin-1")
            return f"The origin {shown!r} may not call this gateway (config cors.allow_origins)."
        if method not in self._config.allow_methods:
            return f"The method {method[:20]!r} is not allowed (config cors.allow_methods)."
        allowed = self._config.allow_headers
        if "*" not in allowed:
            extra = sorted({h for h in headers if h not in allowed})
            if extra:
                return f"Headers not allowed (config cors.allow_headers): {', '.join(extra)[:300]}."
        return None

    def answering(self, origin: bytes, send: Send) -> Send:
        """`send`, its answer's head carrying the CORS headers of an allowed `origin`."""
        extra = [*self._allow_origin(origin), (b"access-control-expose-headers", self._expose)]

        async def with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        return with_cors


def is_preflight(scope: Scope) -> bool:
    return scope["method"] == "OPTIONS" and bool(_header(scope, b"access-control-request-method"))


def _header(scope: Scope, name: bytes) -> bytes:
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for key, value in headers:
        if key == name:
            return value
    return b""
