"""The wheel carries every package and its data files (the Lua scripts, the packaged
configs), and setuptools has nothing to guess: a directory it would take for a package but
that is not listed makes it warn at every install and leaves its files out of the wheel."""

from __future__ import annotations

import fnmatch
import tomllib
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("gateway", "routing", "tiers")


def setuptools_config() -> dict[str, object]:
    config: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
        "setuptools"
    ]
    return config


def source_dirs() -> dict[str, list[Path]]:
    """Dotted name -> its files, for every directory holding files under the packages."""
    found: dict[str, list[Path]] = {}
    for top in TOP:
        for directory in [ROOT / top, *(ROOT / top).rglob("*")]:
            if not directory.is_dir() or "__pycache__" in directory.parts:
                continue
            files = [f for f in directory.iterdir() if f.is_file() and f.suffix != ".pyc"]
            if files:
                found[".".join(directory.relative_to(ROOT).parts)] = files
    return found


def test_every_directory_with_files_is_a_listed_package() -> None:
    packages = set(setuptools_config()["packages"])  # type: ignore[call-overload]
    dirs = source_dirs()
    assert "routing.store.lua" in dirs  # the test sees what it is about
    assert set(dirs) == packages


def test_every_data_file_is_matched_by_package_data() -> None:
    data: dict[str, list[str]] = setuptools_config()["package-data"]  # type: ignore[assignment]
    for package, files in source_dirs().items():
        for file in files:
            if file.suffix == ".py":
                continue
            patterns = data.get(package, [])
            assert any(fnmatch.fnmatch(file.name, p) for p in patterns), (package, file.name)


def test_the_lua_scripts_are_found_as_package_resources() -> None:
    names = {f.name for f in resources.files("routing.store.lua").iterdir()}
    assert {"prelude_names.lua", "acquire.lua", "release.lua"} <= names
