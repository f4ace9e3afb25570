"""The GET routes in process: one model object, the OpenAPI document, the metrics text."""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import httpx
import pytest
from starlette.routing import Route

from gateway.app.front import GatewayApp, build_app
from gateway.runtime.settings import parse_config
from gateway.runtime.state import GatewayState
from gateway.schemas.completions import CompletionRequest

KEY = "sk-routes"
KEY_ONE = "sk-routes-one-model"
KEY_RPM = "sk-routes-rate-limited"
SLASHED = "meta-llama/Llama-2-70b-chat-hf"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


CONFIG = f"""
redis: {{url: "memory://"}}
models:
  "{SLASHED}":
    endpoints: [{{url: "http://127.0.0.1:9", max_concurrency: 2}}]
  demo/llama-3-8b:
    endpoints: [{{url: "http://127.0.0.1:10", max_concurrency: 2}}]
  plain:
    endpoints: [{{url: "http://127.0.0.1:11", max_concurrency: 2}}]
keys:
  - {{sha256: "{_digest(KEY)}", account: all}}
  - {{sha256: "{_digest(KEY_ONE)}", account: one, models: [demo/llama-3-8b]}}
  - {{sha256: "{_digest(KEY_RPM)}", account: rated, rpm: 3, tpm: 1000}}
"""


@pytest.fixture
def app() -> GatewayApp:
    state = GatewayState(parse_config(CONFIG, "routes.yaml"), redis=fakeredis.FakeAsyncRedis())
    return build_app(state)


@pytest.fixture
async def client(app: GatewayApp) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        yield client


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# --- GET /v1/models/{model} ------------------------------------------------------------------


@pytest.mark.parametrize("name", [SLASHED, "demo/llama-3-8b", "plain"])
@pytest.mark.parametrize("encode", [False, True])
async def test_one_model_is_the_object_the_list_holds(
    client: httpx.AsyncClient, name: str, encode: bool
) -> None:
    # The openai SDK percent-encodes the slash (`demo%2Fllama-3-8b`); curl users do not.
    path = "/v1/models/" + (name.replace("/", "%2F") if encode else name)
    resp = await client.get(path, headers=auth(KEY))
    assert resp.status_code == 200, resp.text
    listed = (await client.get("/v1/models", headers=auth(KEY))).json()["data"]
    assert resp.json() == next(m for m in listed if m["id"] == name)
    assert resp.json() == {"id": name, "object": "model", "created": 0, "owned_by": "gateway"}
    assert resp.headers["x-request-id"]


@pytest.mark.parametrize(
    ("key", "name"),
    [(KEY, "no-such-model"), (KEY, "meta-llama"), (KEY_ONE, SLASHED), (KEY_ONE, "plain")],
)
async def test_unknown_or_not_allowed_model_is_a_404(
    client: httpx.AsyncClient, key: str, name: str
) -> None:
    resp = await client.get(f"/v1/models/{name}", headers=auth(key))
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "model_not_found",
        "model",
    )
    assert name in error["message"]


async def test_the_allowed_model_answers_the_limited_key(client: httpx.AsyncClient) -> None:
    resp = await client.get("/v1/models/demo/llama-3-8b", headers=auth(KEY_ONE))
    assert resp.status_code == 200
    assert resp.json()["id"] == "demo/llama-3-8b"


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/plain", "/v1/models/no-such-model"])
async def test_a_rate_limited_key_gets_its_ratelimit_headers_here_too(
    client: httpx.AsyncClient, path: str
) -> None:
    # docs/api.md: OpenAI's x-ratelimit-* on every answer to a key with a limit; a read
    # of the buckets, not a charge.
    resp = await client.get(path, headers=auth(KEY_RPM))
    assert resp.status_code in (200, 404)
    assert {k: v for k, v in resp.headers.items() if k.startswith("x-ratelimit-")} == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "0s", "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "1000", "x-ratelimit-reset-tokens": "0s",
    }  # fmt: skip
    unlimited = await client.get(path, headers=auth(KEY))
    assert not [k for k in unlimited.headers if k.startswith("x-ratelimit-")]


@pytest.mark.parametrize("headers", [{}, auth("sk-wrong")])
async def test_one_model_without_a_valid_key_is_a_401(
    client: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    resp = await client.get("/v1/models/plain", headers=headers)
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "invalid_api_key"
    assert resp.headers["www-authenticate"] == "Bearer"


# --- /openapi.json ---------------------------------------------------------------------------


def _documented(path: str) -> str:
    """A Starlette route path as OpenAPI writes it: `{model:path}` is `{model}`."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path)


async def test_openapi_covers_every_route_of_the_app(
    app: GatewayApp, client: httpx.AsyncClient
) -> None:
    doc = (await client.get("/openapi.json")).json()
    paths: dict[str, Any] = doc["paths"]
    served: set[tuple[str, str]] = {(path, "post") for path in app._hot}
    for route in app._rest.routes:
        assert isinstance(route, Route)
        methods = (route.methods or set()) - {"HEAD"}
        served |= {(_documented(route.path), m.lower()) for m in methods}
    documented = {(path, method) for path, ops in paths.items() for method in ops}
    assert served == documented
    assert {p for p, _ in served} >= {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model}",
        "/healthz",
        "/readyz",
        "/metrics",
        "/openapi.json",
    }


async def test_openapi_refs_all_resolve(client: httpx.AsyncClient) -> None:
    text = (await client.get("/openapi.json")).text
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', text))
    assert refs and refs <= set(schemas)


async def test_openapi_request_schemas_are_the_seeds(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/OpenAICompletionsIn"}
    retrieve = doc["paths"]["/v1/models/{model}"]["get"]
    assert [p["name"] for p in retrieve["parameters"]] == ["model"]
    assert {"200", "401", "404"} <= set(retrieve["responses"])


# --- /metrics --------------------------------------------------------------------------------


async def test_metrics_have_no_created_series_and_count_lost_records(
    app: GatewayApp, client: httpx.AsyncClient
) -> None:
    await client.post("/v1/completions", json={"model": "plain"}, headers=auth(KEY))  # a 422
    text = (await client.get("/metrics")).text
    assert 'gateway_requests_total{code="422",model="",tier=""} 1.0' in text
    assert "_created" not in text
    assert "# TYPE gateway_usage_records_lost_total counter" in text
    assert "\ngateway_usage_records_lost_total 0.0\n" in text
    app.state.admission.ledger.spool.lost = 3  # type: ignore[union-attr]
    assert "\ngateway_usage_records_lost_total 3.0\n" in (await client.get("/metrics")).text


def test_the_published_prompt_schema_admits_a_batch() -> None:
    prompt = CompletionRequest.model_json_schema()["properties"]["prompt"]
    texts = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 64}
    assert texts in prompt["oneOf"]
