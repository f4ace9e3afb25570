"""/openapi.json: the gateway's own OpenAPI document, request schemas from the pydantic models."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.completions.apis import Route

_TIER_HEADER = (
    "Per-request service tier (`priority` or `flex`) for clients that cannot set the "
    "`service_tier` body field. The body field wins; unrecognized values ride the default tier."
)

_VALIDATION_SCHEMAS: dict[str, Any] = {
    "ValidationError": {
        "type": "object",
        "title": "ValidationError",
        "required": ["loc", "msg", "type"],
        "properties": {
            "loc": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
            "msg": {"type": "string"},
            "type": {"type": "string"},
        },
    },
    "HTTPValidationError": {
        "type": "object",
        "title": "HTTPValidationError",
        "properties": {
            "detail": {"type": "array", "items": {"$ref": "#/components/schemas/ValidationError"}}
        },
    },
    "ErrorEnvelope": {
        "type": "object",
        "title": "ErrorEnvelope",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                    "code": {"type": "string"},
                },
            }
        },
    },
}


def _header(name: str, description: str = "") -> dict[str, Any]:
    param: dict[str, Any] = {
        "name": name,
        "in": "header",
        "required": False,
        "schema": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    }
    if description:
        param["description"] = description
    return param


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}},
    }


def _post(summary: str, operation: str, schema_name: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "operationId": operation,
            "security": [{"HTTPBearer": []}],
            "parameters": [
                _header("x-deepinfra-source"),
                _header("x-deepinfra-service-tier", _TIER_HEADER),
                _header("xi-api-key"),
                _header("x-api-key"),
                _header("x-request-id"),
            ],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{schema_name}"}}
                },
            },
            "responses": _responses(),
        }
    }


def _responses() -> dict[str, Any]:
    """The answers of a completion route (docs/api.md)."""
    return {
        "200": {
            "description": "Successful Response (JSON, or text/event-stream when stream)",
            "content": {"application/json": {"schema": {}}, "text/event-stream": {}},
        },
        "401": _error("Missing or unknown API key"),
        "404": _error("Unknown model"),
        "413": _error("Body too large"),
        "422": {
            "description": "Validation Error",
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}
            },
        },
        "429": _error("No capacity now; see Retry-After"),
        "502": _error("The worker failed"),
        "503": _error("Nothing can serve"),
        "504": _error("The worker timed out"),
    }


_MODEL_OBJECT: dict[str, Any] = {
    "type": "object",
    "title": "Model",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string", "const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
    },
}
_MODEL_LIST: dict[str, Any] = {
    "type": "object",
    "title": "ModelList",
    "required": ["object", "data"],
    "properties": {
        "object": {"type": "string", "const": "list"},
        "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}},
    },
}
_STATUS: dict[str, Any] = {
    "type": "object",
    "title": "Status",
    "required": ["status"],
    "properties": {"status": {"type": "string"}, "reason": {"type": "string"}},
}


def _json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _get(summary: str, operation: str, ok: dict[str, Any], **more: Any) -> dict[str, Any]:
    """A GET operation answering 200 with `ok` (a response object), plus `more` fields."""
    return {"get": {"summary": summary, "operationId": operation, "responses": {"200": ok}, **more}}


def _models_paths() -> dict[str, Any]:
    keyed: dict[str, Any] = {"security": [{"HTTPBearer": []}]}
    listed = _get(
        "List the models this key may use",
        "list_models",
        {"description": "OpenAI list object", "content": _json_content(_ref("ModelList"))},
        **keyed,
    )
    listed["get"]["responses"]["401"] = _error("Missing or unknown API key")
    one = _get(
        "One model this key may use",
        "retrieve_model",
        {"description": "OpenAI model object", "content": _json_content(_ref("Model"))},
        parameters=[
            {
                "name": "model",
                "in": "path",
                "required": True,
                "description": "The model name; it may hold slashes (`org/name`).",
                "schema": {"type": "string"},
            }
        ],
        **keyed,
    )
    one["get"]["responses"]["401"] = _error("Missing or unknown API key")
    one["get"]["responses"]["404"] = _error("Unknown model, or not available to this key")
    return {"/v1/models": listed, "/v1/models/{model}": one}


def _ops_paths() -> dict[str, Any]:
    status = {"description": "OK", "content": _json_content(_ref("Status"))}
    ready = _get("Readiness: Redis answers, every model has a healthy endpoint", "readyz", status)
    ready["get"]["responses"]["503"] = {
        "description": "Not ready; `reason` says why",
        "content": _json_content(_ref("Status")),
    }
    metrics = {"description": "Prometheus text format", "content": {"text/plain": {}}}
    document = {"description": "This document", "content": _json_content({"type": "object"})}
    return {
        "/healthz": _get("Liveness: 200 while the process serves", "healthz", status),
        "/readyz": ready,
        "/metrics": _get("Prometheus metrics", "metrics", metrics),
        "/openapi.json": _get("The gateway's OpenAPI document", "openapi", document),
    }


def build_openapi(routes: Sequence[Route]) -> dict[str, Any]:
    schemas: dict[str, Any] = dict(_VALIDATION_SCHEMAS)
    schemas.update(Model=_MODEL_OBJECT, ModelList=_MODEL_LIST, Status=_STATUS)
    for route in routes:
        schema = route.schema.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schema["title"] = route.title
        schemas[route.title] = schema
    posts = {r.path: _post(r.summary, r.operation, r.title) for r in routes}
    return {
        "openapi": "3.1.0",
        "info": {"title": "LLM gateway", "version": "0.2.0"},
        "paths": {**posts, **_models_paths(), **_ops_paths()},
        "components": {
            "schemas": schemas,
            "securitySchemes": {"HTTPBearer": {"type": "http", "scheme": "bearer"}},
        },
    }
