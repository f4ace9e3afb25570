"""The registry: capacity, the tiers a model offers, worker model names."""

from __future__ import annotations

from typing import Any

import pytest

from routing.hop.endpoints import Endpoint
from routing.registry import EndpointConfig, ModelConfig, Registry
from tiers.policy import Tier


def model_config(*concurrency: int, **fields: Any) -> ModelConfig:
    endpoints = [
        {"url": f"http://10.0.0.{i + 1}:8000", "max_concurrency": c}
        for i, c in enumerate(concurrency)
    ]
    return ModelConfig.model_validate({"endpoints": endpoints, **fields})


def test_capacity_is_sum_of_max_concurrency() -> None:
    registry = Registry({"a": model_config(4), "b": model_config(64, 32, 1)})
    assert registry.get("a").capacity == 4  # type: ignore[union-attr]
    assert registry.get("b").capacity == 97  # type: ignore[union-attr]


def test_tiers_always_include_default() -> None:
    registry = Registry({"m": model_config(1, tiers=["priority"])})
    model = registry.get("m")
    assert model is not None
    assert model.tiers == frozenset({Tier.PRIORITY, Tier.DEFAULT})


def test_tiers_default_only_by_default() -> None:
    model = Registry({"m": model_config(1)}).get("m")
    assert model is not None
    assert model.tiers == frozenset({Tier.DEFAULT})


def test_tiers_as_listed() -> None:
    model = Registry({"m": model_config(1, tiers=["flex", "default", "priority"])}).get("m")
    assert model is not None
    assert model.tiers == frozenset(Tier)


def test_lookup_and_iteration() -> None:
    registry = Registry({"b": model_config(1), "a": model_config(2)})
    assert registry.get("missing") is None
    assert registry.names() == ["b", "a"]
    assert [m.name for m in registry] == ["b", "a"]
    assert registry.get("a").config.endpoints[0].max_concurrency == 2  # type: ignore[union-attr]


def test_upstream_model_name_defaults_to_ours() -> None:
    cfg = EndpointConfig.model_validate({"url": "http://w:8000", "max_concurrency": 1})
    assert Endpoint("org/ours", cfg).upstream_model == "org/ours"


def test_upstream_model_name_from_config() -> None:
    cfg = EndpointConfig.model_validate(
        {"url": "http://w:8000/", "max_concurrency": 1, "model": "served-name"}
    )
    endpoint = Endpoint("org/ours", cfg)
    assert endpoint.upstream_model == "served-name"
    assert endpoint.url == "http://w:8000"
    assert endpoint.inflight == 0


def test_base_url_keeps_path_without_trailing_slash() -> None:
    cfg = EndpointConfig.model_validate({"url": "http://w:8000/pool/", "max_concurrency": 1})
    assert cfg.base_url == "http://w:8000/pool"


@pytest.mark.parametrize("concurrency", [0, -1, 100_001])
def test_max_concurrency_bounds(concurrency: int) -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        model_config(concurrency)


@pytest.mark.parametrize("budget", [0, -5, 1_000_000_001, 100.5, True, False, "Auto", "AUTO", ""])
def test_a_bad_token_budget_is_one_error_naming_both_forms(budget: Any) -> None:
    with pytest.raises(ValueError) as caught:
        model_config(4, endpoints=[{"url": "http://w:8000", "max_concurrency": 4,
                                    "max_tokens_in_flight": budget}])  # fmt: skip
    errors = [e for e in caught.value.errors() if "max_tokens_in_flight" in e["loc"]]  # type: ignore[attr-defined]
    assert [e["loc"] for e in errors] == [("endpoints", 0, "max_tokens_in_flight")]
    assert "or auto" in errors[0]["msg"]


@pytest.mark.parametrize("budget", [1, 65_536, "65536", 65_536.0, "auto"])
def test_a_token_budget_is_a_number_or_auto(budget: Any) -> None:
    endpoint = {"url": "http://w:8000", "max_concurrency": 4, "max_tokens_in_flight": budget}
    found = model_config(4, endpoints=[endpoint]).endpoints[0].max_tokens_in_flight
    assert found == (budget if budget == "auto" else int(budget))


@pytest.mark.parametrize(
    "fields",
    [{"partitions": True}, {"max_tokens_default": True}, {"adaptive": {"waiting_threshold": True}},
     {"adaptive": {"min_fraction": True}}, {"adaptive": {"kv_threshold": True}}],
)  # fmt: skip
def test_a_boolean_is_no_number(fields: dict[str, Any]) -> None:
    # YAML's `yes` would otherwise be the number 1: a budget of 1 token, one partition.
    with pytest.raises(ValueError, match="not true or false"):
        model_config(4, 4, **fields)


@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_no_size_nor_queue_bound(value: bool) -> None:
    # `max_concurrency: yes` would be one slot, `max_queue: no` a model that never queues.
    with pytest.raises(ValueError, match="not true or false"):
        model_config(value)
    with pytest.raises(ValueError, match="not true or false"):
        model_config(4, max_queue=value)
