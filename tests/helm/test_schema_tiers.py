"""The chart's values schema names the tiers the gateway knows, in queue order: a new tier
(tiers/policy.py) fails here until the schema has it too. Needs no helm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiers.policy import BY_RANK

SCHEMA = Path(__file__).resolve().parents[2] / "helm" / "values.schema.json"
NAMES = [tier.value for tier in BY_RANK]


def _tier_lists(node: Any, path: str = "") -> list[tuple[str, list[str]]]:
    """Every (path, names) in the schema that lists tiers: an enum, or an object's keys."""
    found: list[tuple[str, list[str]]] = []
    if isinstance(node, dict):
        if set(node.get("enum", [])) & set(NAMES):
            found.append((path, list(node["enum"])))
        props = node.get("properties")
        if path.endswith("/tiers") and isinstance(props, dict):
            found.append((path + "/properties", list(props)))
        for key, value in node.items():
            found += _tier_lists(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _tier_lists(value, f"{path}/{i}")
    return found


def test_every_tier_list_of_the_schema_is_the_tier_table() -> None:
    lists = _tier_lists(json.loads(SCHEMA.read_text(encoding="utf-8")))
    # The keys' and the models' `tiers` enums, and the `gateway.tiers` object.
    assert len(lists) == 3, lists
    for path, names in lists:
        assert names == NAMES, path
