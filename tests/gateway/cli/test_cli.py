"""The command line's own decisions (the commands that serve are tested end to end)."""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.cli.main import _parser, main
from routing.store.keys import USAGE_STREAM
from tests import conftest as root
from tests.factories import usage_record
from tests.test_docs import OUTSIDE

DEMO = str(Path(__file__).resolve().parents[3] / "config" / "demo.yaml")


def test_keys_create_on_a_memory_store_prints_the_config_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["keys", "create", "--config", DEMO, "--account", "acme"]) == 0
    out, err = capsys.readouterr()
    key = out.strip()
    assert key.startswith("gw-")
    assert hashlib.sha256(key.encode()).hexdigest() in err
    assert key not in err


def test_keys_create_takes_a_weight(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "create", "--config", DEMO, "--account", "acme", "--weight", "2.5"]) == 0
    assert "weight: 2.5}" in capsys.readouterr().err


def test_keys_create_takes_rate_limits(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["keys", "create", "--config", DEMO, "--account", "acme", "--rpm", "30", "--tpm", "9000"]
    assert main(args) == 0
    assert "weight: 1, rpm: 30, tpm: 9000}" in capsys.readouterr().err


@pytest.mark.parametrize(("option", "value"), [("--rpm", "0"), ("--tpm", "-1"), ("--rpm", "2e9")])
def test_keys_create_refuses_a_rate_limit_out_of_range(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["keys", "create", "--config", DEMO, "--account", "acme", option, value])
    assert exited.value.code == 2
    assert option in capsys.readouterr().err


@pytest.mark.parametrize("weight", ["0", "-1", "nan", "heavy", "2e6"])
def test_keys_create_refuses_a_weight_out_of_range(
    weight: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["keys", "create", "--config", DEMO, "--account", "acme", "--weight", weight])
    assert exited.value.code == 2
    assert "--weight" in capsys.readouterr().err


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


@pytest.mark.parametrize("count", ["0", "-1", "two", "257"])
def test_workers_out_of_range_is_a_usage_error(
    count: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--config", DEMO, "--workers", count])
    assert exited.value.code == 2
    assert "--workers" in capsys.readouterr().err


def test_workers_need_a_shared_store(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", DEMO, "--workers", "2"]) == 2
    assert "memory://" in capsys.readouterr().err


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[Command]:
    """Every (sub)command's parser with its words on the command line."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


Command = tuple[tuple[str, ...], argparse.ArgumentParser]


def test_every_option_of_every_command_has_help() -> None:
    missing = [
        (" ".join(path), action.dest)
        for path, parser in commands(_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        and (not action.help or action.help == argparse.SUPPRESS)
    ]
    assert missing == []
    assert len(list(commands(_parser()))) == 8  # the test walks the whole tree


def test_every_command_has_help_in_its_parent_s_list() -> None:
    for _, parser in commands(_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                listed = {choice.dest for choice in action._choices_actions}
                assert listed == set(action.choices)
                assert all(choice.help for choice in action._choices_actions)


@pytest.mark.parametrize("path", [path for path, _ in commands(_parser())])
def test_help_cites_nothing_outside_the_repo(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*path, "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "usage: gateway" in text
    assert not OUTSIDE.search(text), path
    if not path:
        assert "docs/cli.md" in text


@pytest.fixture
def many_records() -> Iterator[int]:
    """The stream `usage` of the run's Redis holding far more than a pipe does."""
    client = redis.Redis.from_url(root.REDIS_URL)
    count = 3000
    try:
        client.delete(USAGE_STREAM)
        with client.pipeline(transaction=False) as pipe:
            for n in range(count):
                pipe.xadd(USAGE_STREAM, usage_record(request_id=f"r{n}").to_fields())  # type: ignore[arg-type]
            pipe.execute()
        yield count
    finally:
        client.delete(USAGE_STREAM)
        client.close()


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_usage_export_into_a_reader_that_leaves_early_is_quiet(
    fmt: str, many_records: int, tmp_path: Path
) -> None:
    """`gateway usage export | head -1`: no traceback, no store error, SIGPIPE's status."""
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f'redis: {{url: "{root.REDIS_URL}"}}\n'
        "models: {m: {endpoints: [{url: 'http://127.0.0.1:9', max_concurrency: 1}]}}\n"
    )
    args = ["usage", "export", "--config", str(config), "--format", fmt]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does, long before the export is written
    try:
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    errors = proc.stderr.read().decode()
    proc.stderr.close()
    assert first.strip()
    assert errors == ""
    assert code == 128 + signal.SIGPIPE


def _export_config(tmp_path: Path) -> Path:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f'redis: {{url: "{root.REDIS_URL}"}}\n'
        "models: {m: {endpoints: [{url: 'http://127.0.0.1:9', max_concurrency: 1}]}}\n"
    )
    return config


def test_usage_export_into_a_full_disk_says_so(many_records: int, tmp_path: Path) -> None:
    """A write that fails is not a store error (and not a --since error)."""
    args = ["usage", "export", "--config", str(_export_config(tmp_path)), "--format", "csv"]
    with open("/dev/full", "w") as full:
        ran = subprocess.run(
            [sys.executable, "-m", "gateway", *args],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip
    assert ran.returncode == 1
    assert ran.stderr.splitlines() == [
        "gateway usage export: cannot write the output: No space left on device"
    ]


def test_usage_export_is_utf8_whatever_the_locale(tmp_path: Path) -> None:
    client = redis.Redis.from_url(root.REDIS_URL)
    try:
        client.delete(USAGE_STREAM)
        client.xadd(USAGE_STREAM, usage_record(request_id="r", user="Zoë 東京").to_fields())  # type: ignore[arg-type]
        args = ["usage", "export", "--config", str(_export_config(tmp_path)), "--format", "csv"]
        ran = subprocess.run(
            [sys.executable, "-m", "gateway", *args], capture_output=True, timeout=60,
            env={**os.environ, "PYTHONIOENCODING": "ascii"},
        )  # fmt: skip
    finally:
        client.delete(USAGE_STREAM)
        client.close()
    assert ran.returncode == 0, ran.stderr
    assert "Zoë 東京" in ran.stdout.decode()
