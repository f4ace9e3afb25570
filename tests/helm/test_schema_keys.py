"""The chart's values schema takes every key a model and an endpoint may have in the
gateway's config (routing/registry.py): a key added there and not here would make `helm
install` refuse a valid config (`additionalProperties: false`). Needs no helm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from routing.registry import EndpointConfig, ModelConfig

SCHEMA = Path(__file__).resolve().parents[2] / "helm" / "values.schema.json"


def model_schema() -> dict[str, Any]:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    found: dict[str, Any] = schema["properties"]["gateway"]["properties"]["models"]
    return found["additionalProperties"]


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
