"""The config loader: env expansion, one-line errors naming the bad key, defaults, shipped files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.runtime.settings import (
    ConfigError,
    GatewayConfig,
    load_config,
    packaged_config,
    parse_config,
)
from tiers.policy import Tier, TierPolicy

ROOT = Path(__file__).resolve().parents[3]
MODEL = "org/model-1"


def config_dict(**overrides: Any) -> dict[str, Any]:
    """The smallest valid config as a dict; top-level keys replaced by `overrides`."""
    raw: dict[str, Any] = {
        "models": {MODEL: {"endpoints": [{"url": "http://10.0.0.5:8000", "max_concurrency": 4}]}}
    }
    raw.update(overrides)
    return raw


def parse(raw: dict[str, Any], environ: dict[str, str] | None = None) -> GatewayConfig:
    return parse_config(yaml.safe_dump(raw), "test.yaml", {} if environ is None else environ)


def config_error(raw: dict[str, Any] | str, environ: dict[str, str] | None = None) -> str:
    text = raw if isinstance(raw, str) else yaml.safe_dump(raw)
    with pytest.raises(ConfigError) as info:
        parse_config(text, "test.yaml", {} if environ is None else environ)
    message = str(info.value)
    assert "\n" not in message
    return message


def endpoint(**fields: Any) -> dict[str, Any]:
    return {"url": "http://10.0.0.5:8000", "max_concurrency": 4, **fields}


def one_model(**fields: Any) -> dict[str, Any]:
    return {MODEL: {"endpoints": [endpoint()], **fields}}


# --- environment expansion ---------------------------------------------------------------


def test_env_var_expands_inside_a_string() -> None:
    raw = config_dict(redis={"url": "redis://${REDIS_HOST}:6379/0"})
    cfg = parse(raw, {"REDIS_HOST": "cache.internal"})
    assert cfg.redis.url == "redis://cache.internal:6379/0"


def test_env_default_used_when_var_unset() -> None:
    raw = config_dict(redis={"url": "redis://${REDIS_HOST:-127.0.0.9}:6379/0"})
    assert parse(raw, {}).redis.url == "redis://127.0.0.9:6379/0"


def test_env_value_beats_default() -> None:
    raw = config_dict(redis={"url": "redis://${REDIS_HOST:-127.0.0.9}:6379/0"})
    assert parse(raw, {"REDIS_HOST": "r1"}).redis.url == "redis://r1:6379/0"


def test_env_var_set_to_empty_is_used_not_the_default() -> None:
    raw = config_dict(listen={"host": "${HOST:-0.0.0.0}"})
    assert parse(raw, {"HOST": ""}).listen.host == ""


def test_env_expansion_in_list_items_and_numbers_coerced() -> None:
    raw = config_dict(
        listen={"port": "${PORT:-8123}"},
        models={MODEL: {"endpoints": [endpoint(url="http://${W}:9000")]}},
    )
    cfg = parse(raw, {"W": "worker-a"})
    assert cfg.listen.port == 8123
    assert cfg.models[MODEL].endpoints[0].base_url == "http://worker-a:9000"


def test_expanded_values_are_not_expanded_again() -> None:
    raw = config_dict(listen={"host": "${A}"})
    assert parse(raw, {"A": "${B}", "B": "nope"}).listen.host == "${B}"


def test_missing_env_var_is_an_error_naming_key_and_variable() -> None:
    raw = config_dict(models={MODEL: {"endpoints": [endpoint(url="http://${WORKER_HOST}")]}})
    message = config_error(raw)
    assert "WORKER_HOST" in message
    assert f"models.{MODEL}.endpoints.0.url" in message


def test_environ_none_reads_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GW_TEST_HOST", "from-os")
    raw = config_dict(listen={"host": "${GW_TEST_HOST}"})
    assert parse_config(yaml.safe_dump(raw), "t.yaml").listen.host == "from-os"


# --- one-line errors ---------------------------------------------------------------------


def test_bad_value_names_the_dotted_key() -> None:
    raw = config_dict(models={"m": {"endpoints": [endpoint(max_concurrency=0)]}})
    message = config_error(raw)
    assert message.startswith("test.yaml: models.m.endpoints.0.max_concurrency:")


def test_unknown_key_is_reported_as_such() -> None:
    message = config_error(config_dict(listen={"hots": "x"}))
    assert message == "test.yaml: listen.hots: unknown key"


def test_unknown_top_level_key() -> None:
    assert "modles: unknown key" in config_error(config_dict(modles={}))


def test_several_errors_say_how_many_more() -> None:
    raw = config_dict(listen={"port": 0, "bogus": 1})
    assert "(and 1 more)" in config_error(raw)


def test_bad_yaml_names_the_line() -> None:
    message = config_error("listen:\n  host: [unclosed\nmodels: {}\n")
    assert message.startswith("test.yaml:")
    assert "not valid YAML" in message
    assert "line " in message


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(text: str) -> None:
    assert "top level must be a mapping" in config_error(text)


def test_models_are_required() -> None:
    assert config_error("listen: {port: 8000}\n").startswith("test.yaml: models:")


def test_empty_models_rejected() -> None:
    assert "models" in config_error(config_dict(models={}))


def test_model_without_endpoints_rejected() -> None:
    assert f"models.{MODEL}.endpoints" in config_error(config_dict(models={MODEL: {}}))


def test_load_config_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(missing, {})


def test_load_config_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(config_dict(listen={"port": 9001})), encoding="utf-8")
    assert load_config(path, {}).listen.port == 9001


def test_load_config_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(config_dict(listen={"port": 70000})), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path, {})
    assert str(info.value).startswith(f"{path}: listen.port:")


# --- defaults ------------------------------------------------------------------------------


def test_tier_defaults() -> None:
    tiers = parse(config_dict()).tiers
    got = {
        tier: (
            tiers.policy(tier).max_utilization,
            tiers.policy(tier).queue_timeout_s,
            tiers.policy(tier).price_multiplier,
        )
        for tier in Tier
    }
    assert got == {
        Tier.PRIORITY: (1.0, 60.0, 1.5),
        Tier.DEFAULT: (1.0, 30.0, 1.0),
        Tier.FLEX: (0.8, 10.0, 0.5),
    }


def test_overriding_one_tier_keeps_the_other_tiers_defaults() -> None:
    tiers = parse(config_dict(tiers={"default": {"queue_timeout_s": 5}})).tiers
    assert tiers.default.queue_timeout_s == 5.0
    assert tiers.priority == TierPolicy(
        queue_timeout_s=60.0, price_multiplier=1.5, may_preempt=True
    )
    assert tiers.flex.max_utilization == 0.8


@pytest.mark.parametrize(
    ("tier", "given", "expected"),
    [
        ("flex", {"queue_timeout_s": 5}, (0.8, 5.0, 0.5)),
        ("priority", {"max_utilization": 0.9}, (0.9, 60.0, 1.5)),
    ],
)
def test_partial_tier_override_keeps_that_tiers_defaults(
    tier: str, given: dict[str, float], expected: tuple[float, float, float]
) -> None:
    policy = parse(config_dict(tiers={tier: given})).tiers.policy(Tier(tier))
    assert (policy.max_utilization, policy.queue_timeout_s, policy.price_multiplier) == expected


def test_other_defaults() -> None:
    cfg = parse(config_dict())
    assert (cfg.listen.host, cfg.listen.port) == ("0.0.0.0", 8000)
    assert cfg.redis.url == "redis://127.0.0.1:6379/0"
    assert cfg.redis.lease_ttl_s == 30.0
    assert cfg.redis.on_outage == "reject"
    assert cfg.limits.max_body_bytes == 10 * 1024 * 1024
    assert cfg.keys == ()
    model = cfg.models[MODEL]
    assert model.tiers == (Tier.DEFAULT,)
    assert model.max_queue == 100
    assert model.worker_priority is False


def test_tier_utilization_above_one_rejected() -> None:
    message = config_error(config_dict(tiers={"flex": {"max_utilization": 1.5}}))
    assert message.startswith("test.yaml: tiers.flex.max_utilization:")


def test_unknown_tier_name_in_model_rejected() -> None:
    message = config_error(config_dict(models=one_model(tiers=["default", "gold"])))
    assert f"models.{MODEL}.tiers.1" in message


# --- shipped configs -----------------------------------------------------------------------


def test_demo_config_loads() -> None:
    cfg = load_config(ROOT / "config" / "demo.yaml", {})
    assert cfg.redis.url == "memory://"
    llama = cfg.models["demo/llama-3-8b"]
    assert [e.base_url for e in llama.endpoints] == [
        "http://127.0.0.1:8101",
        "http://127.0.0.1:8102",
    ]


def test_demo_config_takes_worker_addresses_from_env() -> None:
    env = {"GATEWAY_DEMO_WORKER_A": "http://127.0.0.1:9001"}
    cfg = load_config(ROOT / "config" / "demo.yaml", env)
    assert cfg.models["demo/llama-3-8b"].endpoints[0].base_url == "http://127.0.0.1:9001"


def test_packaged_demo_config_loads() -> None:
    cfg = parse_config(packaged_config("demo.yaml"), "demo.yaml", {})
    assert "demo/llama-3-8b" in cfg.models


def test_example_config_loads_with_empty_environment() -> None:
    cfg = load_config(ROOT / "config" / "example.yaml", environ={})
    assert cfg.redis.url == "redis://127.0.0.1:6379/0"
    model = cfg.models["meta-llama/Llama-2-70b-chat-hf"]
    assert set(model.tiers) == {Tier.DEFAULT, Tier.PRIORITY, Tier.FLEX}
    assert model.endpoints[1].model == "llama-2-70b"
    assert model.endpoints[1].api_key is None
    assert cfg.keys[0].account == "acme"
    assert cfg.keys[0].tiers == (Tier.DEFAULT, Tier.FLEX)
    assert (cfg.keys[0].rpm, cfg.accounts["acme"].tpm) == (600, 4_000_000)


# --- field checks --------------------------------------------------------------------------


def test_empty_endpoint_api_key_becomes_none() -> None:
    raw = config_dict(models={MODEL: {"endpoints": [endpoint(api_key="${WORKER_KEY:-}")]}})
    assert parse(raw).models[MODEL].endpoints[0].api_key is None


def test_endpoint_api_key_kept_when_set() -> None:
    raw = config_dict(models={MODEL: {"endpoints": [endpoint(api_key="${WORKER_KEY:-}")]}})
    assert parse(raw, {"WORKER_KEY": "s3cret"}).models[MODEL].endpoints[0].api_key == "s3cret"


def test_endpoint_api_key_not_in_repr() -> None:
    raw = config_dict(models={MODEL: {"endpoints": [endpoint(api_key="s3cret")]}})
    assert "s3cret" not in repr(parse(raw))


@pytest.mark.parametrize(
    "urls",
    [
        ["http://10.0.0.5:8000", "http://10.0.0.5:8000"],
        ["http://10.0.0.5:8000", "http://10.0.0.5:8000/"],
    ],
)
def test_duplicate_endpoint_urls_rejected(urls: list[str]) -> None:
    raw = config_dict(models={MODEL: {"endpoints": [endpoint(url=u) for u in urls]}})
    message = config_error(raw)
    assert f"models.{MODEL}.endpoints" in message
    assert "distinct" in message


def test_same_url_in_two_models_is_fine() -> None:
    raw = config_dict(models={"a": one_model()[MODEL], "b": one_model()[MODEL]})
    assert set(parse(raw).models) == {"a", "b"}


@pytest.mark.parametrize(
    "name", ["has space", "deploy_id:abc", "org/model:rev", "user@host", "-leading", "x" * 257]
)
def test_bad_model_names_rejected(name: str) -> None:
    message = config_error(config_dict(models={name: one_model()[MODEL]}))
    assert message.startswith("test.yaml: models")
    assert "model name" in message


@pytest.mark.parametrize("name", ["gpt-4o", "meta-llama/Llama-2-70b-chat-hf", "a.b_c/d-1", "x"])
def test_plain_model_names_accepted(name: str) -> None:
    assert name in parse(config_dict(models={name: one_model()[MODEL]})).models


@pytest.mark.parametrize(
    "url", ["redis://h:6379/0", "rediss://h:6380/1", "unix:///tmp/redis.sock", "memory://"]
)
def test_known_redis_url_schemes(url: str) -> None:
    assert parse(config_dict(redis={"url": url})).redis.url == url


@pytest.mark.parametrize("url", ["http://h:6379", "localhost:6379", "", "REDIS://h"])
def test_unknown_redis_url_scheme_rejected(url: str) -> None:
    message = config_error(config_dict(redis={"url": url}))
    assert message.startswith("test.yaml: redis.url:")
    assert "redis://" in message


def test_redis_url_not_in_repr() -> None:
    cfg = parse(config_dict(redis={"url": "redis://:hunter2@h:6379/0"}))
    assert "hunter2" not in repr(cfg)


def test_on_outage_choices() -> None:
    assert parse(config_dict(redis={"on_outage": "local"})).redis.on_outage == "local"
    assert config_error(config_dict(redis={"on_outage": "ignore"})).startswith(
        "test.yaml: redis.on_outage:"
    )


def test_key_digest_lowercased_and_checked() -> None:
    digest = "AB" * 32
    cfg = parse(config_dict(keys=[{"sha256": digest, "account": "acme"}]))
    assert cfg.keys[0].sha256 == digest.lower()
    assert cfg.keys[0].max_concurrency == 200
    assert config_error(config_dict(keys=[{"sha256": "abc", "account": "a"}])).startswith(
        "test.yaml: keys.0.sha256:"
    )


def test_a_redis_url_that_cannot_be_parsed_never_shows_its_password() -> None:
    """A base64 password holds "/": the URL then cannot be parsed, and redis-py's message
    would quote the password's first half."""
    text = (
        'redis: {url: "redis://:Zm9vYmFy/c2VjcmV0@127.0.0.1:6399/0"}\n'
        "models: {m: {endpoints: [{url: 'http://127.0.0.1:9', max_concurrency: 1}]}}\n"
    )
    with pytest.raises(ConfigError) as raised:
        parse_config(text, "gw.yaml")
    assert "redis.url: " in str(raised.value) and "%2F" in str(raised.value)
    assert "Zm9vYmFy" not in str(raised.value) and "c2VjcmV0" not in str(raised.value)
    parse_config(text.replace("Zm9vYmFy/", "Zm9vYmFy%2F"), "gw.yaml")  # encoded: fine


# --- fair share ----------------------------------------------------------------------------


def test_tiers_share_between_accounts_unless_told_fifo() -> None:
    tiers = parse(config_dict(tiers={"flex": {"fairness": "fifo"}})).tiers
    assert [tiers.policy(t).fairness for t in Tier] == ["accounts", "accounts", "fifo"]


def test_unknown_fairness_rejected() -> None:
    message = config_error(config_dict(tiers={"default": {"fairness": "requests"}}))
    assert "tiers.default.fairness" in message


def test_key_weight_defaults_to_one_and_must_be_positive() -> None:
    key = {"sha256": "ab" * 32, "account": "acme"}
    assert parse(config_dict(keys=[key])).keys[0].weight == 1.0
    assert parse(config_dict(keys=[{**key, "weight": 2.5}])).keys[0].weight == 2.5
    for bad in (0, -1, "lots"):
        assert "keys.0.weight" in config_error(config_dict(keys=[{**key, "weight": bad}]))


@pytest.mark.parametrize("where", ["keys", "accounts"])
@pytest.mark.parametrize("limit", ["rpm", "tpm"])
def test_rate_limits_are_whole_numbers_never_booleans(where: str, limit: str) -> None:
    key = {"sha256": "ab" * 32, "account": "acme"}

    def raw(value: Any) -> dict[str, Any]:
        if where == "keys":
            return config_dict(keys=[{**key, limit: value}])
        return config_dict(keys=[key], accounts={"acme": {limit: value}})

    at = f"keys.0.{limit}" if where == "keys" else f"accounts.acme.{limit}"
    for bad in (0, -1, 1.5, "lots", True, False):
        assert config_error(raw(bad)).startswith(f"test.yaml: {at}: ")
    assert "not true or false" in config_error(raw(True))  # `rpm: yes` is no limit of 1
    cfg = parse(raw("${LIMIT}"), {"LIMIT": "600"})  # from the environment: a string
    found = cfg.keys[0] if where == "keys" else cfg.accounts["acme"]
    assert getattr(found, limit) == 600


@pytest.mark.parametrize("field", ["max_concurrency", "weight"])
def test_a_keys_concurrency_and_weight_are_never_booleans(field: str) -> None:
    # `max_concurrency: yes` would hold the account to one request in flight.
    key = {"sha256": "ab" * 32, "account": "acme"}
    for bad in (True, False):
        message = config_error(config_dict(keys=[{**key, field: bad}]))
        assert message.startswith(f"test.yaml: keys.0.{field}: ")
        assert "not true or false" in message
    assert getattr(parse(config_dict(keys=[{**key, field: 3}])).keys[0], field) == 3
