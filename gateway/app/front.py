"""The ASGI application: the two hot routes as plain ASGI, the rest on Starlette.

`build_app(config)` returns an app whose lifespan starts and stops the GatewayState. The
front dispatcher sends `POST /v1/completions` and `/v1/chat/completions` straight to their
CompletionRoute (gateway/completions/route.py: no Starlette request objects or middleware on
the hot path); everything else (the operator routes: models, health, readiness, metrics, the
OpenAPI document) goes through a small Starlette app.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.app.cors import Cors, is_preflight, origin_of
from gateway.app.openapi import build_openapi
from gateway.completions.apis import ROUTES
from gateway.completions.route import CompletionRoute
from gateway.edge.asgi import (
    Receive,
    Scope,
    Send,
    error_parts,
    read_headers,
    request_id,
    send_error,
)
from gateway.errors import GatewayError, MethodNotAllowed, ModelNotFound, NotFound
from gateway.metrics import CONTENT_TYPE
from gateway.ratelimits import Headers
from gateway.runtime.auth import Account, key_from_headers
from gateway.runtime.settings import CorsConfig
from gateway.runtime.state import GatewayState


class GatewayApp:
    """Front dispatcher: hot routes to their CompletionRoute, the rest to Starlette."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self._hot = {route.path: CompletionRoute(state, route) for route in ROUTES}
        self._openapi = orjson.dumps(build_openapi(ROUTES))
        self._rest = self._build_starlette()
        self._cors: tuple[CorsConfig, Cors] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            cors = self._cors_of(self.state.config.cors)
            origin = None if cors is None else origin_of(scope)
            if cors is not None and origin is not None:
                if is_preflight(scope):
                    await cors.preflight(scope, origin, send)
                    return
                if cors.allows(origin):
                    send = cors.answering(origin, send)
            proxy = self._hot.get(scope["path"])
            if proxy is not None:
                if scope["method"] == "POST":
                    await proxy(scope, receive, send)
                else:
                    await self._post_only(scope, send, cors is not None)
                return
        await self._rest(scope, receive, send)

    def _cors_of(self, config: CorsConfig) -> Cors | None:
        """The CORS answers of the config now (None: off), made again after a reload."""
        if not config.allow_origins:
            return None
        if self._cors is None or self._cors[0] is not config:
            self._cors = (config, Cors(config))
        return self._cors[1]

    async def _post_only(self, scope: Scope, send: Send, cors: bool) -> None:
        """Any other method on a completion route: 405, with the methods it takes (RFC 9110)."""
        allow = "OPTIONS, POST" if cors else "POST"
        error = MethodNotAllowed(
            f"Method {scope['method'][:20]} is not allowed on {scope['path'][:200]}; use POST.",
            headers={"Allow": allow},
        )
        await send_error(send, error, request_id(read_headers(scope).request_id))

    def _build_starlette(self) -> Starlette:
        @asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            await self.state.start()
            try:
                yield
            finally:
                await self.state.close()

        routes = [
            Route("/v1/models", self._models, methods=["GET"]),
            # `path`: model names hold slashes (meta-llama/Llama-2-70b-chat-hf).
            Route("/v1/models/{model:path}", self._model, methods=["GET"]),
            Route("/healthz", self._healthz, methods=["GET"]),
            Route("/readyz", self._readyz, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/openapi.json", self._openapi_json, methods=["GET"]),
        ]
        handlers = {GatewayError: self._gateway_error, HTTPException: self._http_error}
        return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)  # type: ignore[arg-type]

    async def _models(self, request: Request) -> Response:
        account = await self._account(request)
        data = [_model_object(name) for name in self._allowed_models(account)]
        limits = await self.state.quota_headers(account)
        return _json({"object": "list", "data": data}, request, extra=limits)

    async def _model(self, request: Request) -> Response:
        """One model object; unknown and not-allowed look alike (404), as on the POSTs."""
        name: str = request.path_params["model"]
        account = await self._account(request)
        limits = await self.state.quota_headers(account)
        if name not in self._allowed_models(account):
            shown = repr(name[:256])
            error = ModelNotFound(
                f"The model {shown} does not exist or is not available to this key."
            )
            return _error_response(request, error, limits)
        return _json(_model_object(name), request, extra=limits)

    async def _account(self, request: Request) -> Account:
        """The request's key's account (401 without a valid key)."""
        h = request.headers
        return await self.state.keys.authenticate(
            key_from_headers(h.get("authorization"), h.get("x-api-key"), h.get("xi-api-key"))
        )

    def _allowed_models(self, account: Account) -> list[str]:
        """The configured models this account's key may use."""
        names = self.state.registry.names()
        return [n for n in names if account.models is None or n in account.models]

    async def _healthz(self, request: Request) -> Response:
        return _json({"status": "ok"}, request)

    async def _readyz(self, request: Request) -> Response:
        """docs/api.md: 503 with the reason while draining, while a model has no healthy
        endpoint, or while Redis does not answer within the command timeout or cannot serve
        (the cause: "redis: WRONGPASS ...", "redis: not a master (sentinel)")."""
        reason = self.state.unready() or await self.state.store_unready()
        if reason is not None:
            return _json({"status": "unavailable", "reason": reason}, request, 503)
        return _json({"status": "ready"}, request)

    async def _metrics(self, request: Request) -> Response:
        rid = {"x-request-id": request_id(request.headers.get("x-request-id"))}
        return Response(self.state.render_metrics(), headers=rid, media_type=CONTENT_TYPE)

    async def _openapi_json(self, request: Request) -> Response:
        rid = {"x-request-id": request_id(request.headers.get("x-request-id"))}
        return Response(self._openapi, headers=rid, media_type="application/json")

    async def _gateway_error(self, request: Request, exc: GatewayError) -> Response:
        return _error_response(request, exc)

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 405:  # Starlette's own says which methods the route takes
            allow = (exc.headers or {}).get("Allow", "GET, HEAD")
            error = MethodNotAllowed(f"Method {request.method[:20]} is not allowed; use {allow}.",
                                     headers={"Allow": allow})  # fmt: skip
            return await self._gateway_error(request, error)
        return await self._gateway_error(request, NotFound(f"No route {request.url.path[:200]}."))


def _model_object(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "gateway"}


def _json(payload: object, request: Request, status: int = 200, extra: Headers = ()) -> Response:
    """`extra`: headers every answer to this caller carries (a rate-limited key's)."""
    rid = request_id(request.headers.get("x-request-id"))
    headers = {"x-request-id": rid, **{k.decode(): v.decode() for k, v in extra}}
    return Response(orjson.dumps(payload), status, headers, "application/json")


def _error_response(request: Request, exc: GatewayError, extra: Headers = ()) -> Response:
    rid = request_id(request.headers.get("x-request-id"))
    status, body, headers = error_parts(exc, rid, extra)
    return Response(body, status, {k.decode(): v.decode() for k, v in headers}, "application/json")


def build_app(state: GatewayState) -> GatewayApp:
    return GatewayApp(state)
