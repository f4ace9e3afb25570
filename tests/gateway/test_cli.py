"""The command line's own decisions (the commands that serve are tested end to end)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from gateway.cli import main

DEMO = str(Path(__file__).resolve().parents[2] / "config" / "demo.yaml")


def test_keys_create_on_a_memory_store_prints_the_config_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["keys", "create", "--config", DEMO, "--account", "acme"]) == 0
    out, err = capsys.readouterr()
    key = out.strip()
    assert key.startswith("gw-")
    assert hashlib.sha256(key.encode()).hexdigest() in err
    assert key not in err


def test_usage_export_refuses_an_unknown_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["usage", "export", "--config", DEMO, "--by", "account,colour"]) == 2
    assert "colour" in capsys.readouterr().err


def test_a_bad_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: {m: {endpoints: [{url: 'http://x', max_concurrency: 0}]}}\n")
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "models.m.endpoints.0.max_concurrency" in err
