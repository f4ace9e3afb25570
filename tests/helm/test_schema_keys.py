"""The chart's values schema takes every key a model, an endpoint, a tier, a key and an
account may have in the gateway's config (routing/registry.py, tiers/policy.py,
gateway/runtime/settings.py): a key added there and not here would make `helm
install` refuse a valid config (`additionalProperties: false`). Needs no helm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.runtime.settings import AccountConfig, CorsConfig, KeyConfig
from routing.registry import EndpointConfig, ModelConfig
from tiers.policy import Tier, TierPolicy

SCHEMA = Path(__file__).resolve().parents[2] / "helm" / "values.schema.json"


def model_schema() -> dict[str, Any]:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    models: dict[str, Any] = schema["properties"]["gateway"]["properties"]["models"]
    found: dict[str, Any] = models["additionalProperties"]
    return found


def test_the_schema_takes_every_key_of_a_model() -> None:
    assert set(model_schema()["properties"]) == set(ModelConfig.model_fields)


def test_the_schema_takes_every_key_of_an_endpoint() -> None:
    endpoint = model_schema()["properties"]["endpoints"]["items"]
    assert set(endpoint["properties"]) == set(EndpointConfig.model_fields)


def test_the_schemas_bounds_of_partitions_are_the_configs() -> None:
    bounds = model_schema()["properties"]["partitions"]
    field = ModelConfig.model_fields["partitions"]
    limits = {type(m).__name__: m for m in field.metadata}
    assert (bounds["minimum"], bounds["maximum"]) == (limits["Ge"].ge, limits["Le"].le)


def gateway_schema() -> dict[str, Any]:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    found: dict[str, Any] = schema["properties"]["gateway"]["properties"]
    return found


def test_the_schema_takes_every_key_of_a_tier() -> None:
    for tier in Tier:
        assert set(gateway_schema()["tiers"]["properties"][tier.value]["properties"]) == set(
            TierPolicy.model_fields
        ), tier


def test_the_schema_takes_every_key_of_a_key_and_an_account() -> None:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    digest = schema["properties"]["keys"]["properties"]["digests"]["items"]["properties"]
    assert set(digest) == set(KeyConfig.model_fields)
    account = gateway_schema()["accounts"]["additionalProperties"]["properties"]
    assert set(account) == set(AccountConfig.model_fields)


def test_the_schema_takes_every_key_of_cors() -> None:
    assert set(gateway_schema()["cors"]["properties"]) == set(CorsConfig.model_fields)
