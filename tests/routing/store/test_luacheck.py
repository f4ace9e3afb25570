"""The Lua scripts as Redis runs them are luacheck clean: the library of Redis Functions
(every script's code and the whole prelude in one chunk) with every warning on, each script
as EVALSHA runs it (its prelude around it) for what would fail at run time (an undefined
name reads as a global: nil, an error only when the line runs). luacheck is Debian's
lua-check; .ci/run installs it, and under GATEWAY_CI=1 a missing one fails."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from routing.store.scripts import _PLAIN, Scripts

ARGS = ["--std", "lua51", "--globals", "redis", "KEYS", "ARGV", "--no-max-line-length",
        "--no-color", "--codes", "-q"]  # fmt: skip


def luacheck() -> str:
    found = shutil.which("luacheck")
    if found is None:
        if os.environ.get("GATEWAY_CI") == "1":
            pytest.fail("luacheck is missing: apt-get install lua-check")
        pytest.skip("luacheck is not installed (Debian: apt-get install lua-check)")
    return found


def check(tmp_path: Path, texts: dict[str, str], *only: str) -> str:
    """luacheck's findings over `texts` (name -> code); '' when clean."""
    paths = []
    for name, code in texts.items():
        path = tmp_path / f"{name}.lua"
        path.write_text(code, encoding="utf-8")
        paths.append(str(path))
    selection = ["--only", *only] if only else []
    done = subprocess.run(
        [luacheck(), *paths, *ARGS, *selection], capture_output=True, text=True, timeout=60
    )
    return "" if done.returncode == 0 else done.stdout + done.stderr


def test_the_library_and_the_plain_scripts_are_clean(tmp_path: Path) -> None:
    sources = Scripts().sources()
    texts = {"library": sources["library"], **{n: sources[n] for n in _PLAIN}}
    assert check(tmp_path, texts) == ""


def test_no_script_reads_a_name_it_does_not_define(tmp_path: Path) -> None:
    """As scripts, each holds the whole prelude and uses a part (unused names are fine);
    a name neither it nor the prelude defines is a bug (codes 0xx syntax, 1xx globals)."""
    assert check(tmp_path, Scripts().sources(), "0", "1") == ""


def test_a_name_the_prelude_lacks_is_found(tmp_path: Path) -> None:
    """The check itself: a script that reads a name nothing defines is caught."""
    assert "W113" in check(tmp_path, {"bad": "return undefined_thing(KEYS[1])"}, "0", "1")
