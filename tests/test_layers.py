"""The rooms stay rooms: which package may import which is this one table, checked on every
import of every module of gateway/, routing/ and tiers/.

The walk goes one way: the edge calls into routing/ and tiers/, never the reverse; routing/
and tiers/ raise their own errors as data (routing/errors.py), and the gateway decides what
the caller sees. An import of gateway/ from below would let HTTP leak downwards again.
Inside each, a room imports only the rooms below it, no module imports itself back through
others (no circle), and every module and function stays small enough to read.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("gateway", "routing", "tiers")
ROUTING = {
    "routing", "routing.store", "routing.ledger", "routing.admission", "routing.hop",
    "routing.choice",
}  # fmt: skip
GATEWAY_BELOW_APP = {"gateway", "gateway.edge", "gateway.runtime", "gateway.schemas"}
# Each package (a room, or the shared modules at the top of gateway/ and routing/) and the
# packages its modules may import besides their own: always downwards, never a circle.
MAY_IMPORT: dict[str, set[str]] = {
    "tiers": set(),
    # (the scripts hold one queue per tier: their count comes from the tier table)
    "routing.store": {"tiers"},
    "routing": {"routing.store", "tiers"},
    "routing.ledger": {"routing", "routing.store", "tiers"},
    "routing.choice": set(),
    "routing.admission": {"routing", "routing.store", "routing.ledger", "routing.choice", "tiers"},
    "routing.hop": {"routing", "routing.choice", "tiers"},
    "gateway": {"routing", "tiers"},
    "gateway.edge": {"gateway"},
    "gateway.schemas": {"tiers"},
    "gateway.sim": {"gateway.edge"},
    "gateway.runtime": {"gateway", *ROUTING, "tiers"},
    "gateway.completions": {*GATEWAY_BELOW_APP, *ROUTING, "tiers"},
    "gateway.app": {*GATEWAY_BELOW_APP, "gateway.completions"},
    "gateway.cli": {*GATEWAY_BELOW_APP, "gateway.app", "gateway.sim", *ROUTING, "tiers"},
}
# `python -m gateway`: the entry, which only starts the CLI.
ENTRY = {"gateway.__main__": {"gateway.cli"}}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 40


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(name: str) -> bool:
    return (ROOT / name.replace(".", "/") / "__init__.py").is_file()


def package_of(name: str) -> str:
    """The package a module belongs to (a package is its own)."""
    return name if is_package(name) else name.rpartition(".")[0]


def imported(source: str, module: str, *, package: bool = False) -> list[str]:
    """Every module `source` (the text of `module`) imports, anywhere in it, absolute:
    relative imports resolved, and `from a import b` read as the module a.b where a/b is one."""
    here = module.split(".") if package else module.split(".")[:-1]
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            origin = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                found = is_package(sub) or (ROOT / (sub.replace(".", "/") + ".py")).is_file()
                names.append(sub if found else origin)
    return names


def ours(names: list[str]) -> list[str]:
    return [n for n in names if n.split(".")[0] in TOPS]


def modules() -> Iterator[tuple[str, Path]]:
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield module_of(path), path


MODULES = dict(modules())


def imports_of(name: str) -> list[str]:
    path = MODULES[name]
    package = path.name == "__init__.py"
    return ours(imported(path.read_text(encoding="utf-8"), name, package=package))


def test_the_modules_are_found() -> None:
    assert {"routing.admission.admit", "routing.store.base", "gateway.edge.protocol"} <= set(
        MODULES
    )


def test_every_package_has_a_place_in_the_table() -> None:
    packages = {package_of(name) for name in MODULES if name not in ENTRY}
    assert packages == set(MAY_IMPORT)


def test_the_table_points_down() -> None:
    """The table itself has no circle: its packages fall into layers, each importing only
    those below it."""
    placed: list[str] = []
    left = dict(MAY_IMPORT)
    while left:
        ready = [p for p, allowed in left.items() if allowed <= set(placed)]
        assert ready, f"a circle in the table among {sorted(left)}"
        placed.extend(ready)
        for p in ready:
            del left[p]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_module_imports_only_the_rooms_below_its_own(name: str) -> None:
    own = package_of(name)
    allowed = ENTRY.get(name) or MAY_IMPORT[own]
    wrong = [n for n in imports_of(name) if package_of(n) not in allowed | {own}]
    assert wrong == [], f"{name} ({own}) imports {wrong}; it may import {sorted(allowed)}"


def test_no_import_circle() -> None:
    """No module reaches itself through its imports (of any kind: at the top, inside a
    function, under TYPE_CHECKING)."""
    graph = {name: {n for n in imports_of(name) if n in MODULES} for name in MODULES}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            raise AssertionError("import circle: " + " -> ".join([*trail, name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_modules_and_functions_stay_small() -> None:
    big = []
    for name, path in MODULES.items():
        source = path.read_text(encoding="utf-8")
        if (lines := len(source.splitlines())) > MAX_MODULE_LINES:
            big.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (length := (node.end_lineno or node.lineno) - first + 1) > MAX_FUNCTION_LINES:
                    big.append(f"{name}.{node.name}: {length} lines")
    assert big == [], "past the bounds (module 400 lines, function 40): " + ", ".join(big)


def test_every_form_of_an_import_is_seen() -> None:
    source = (
        "import gateway.errors\n"
        "from gateway import edge\n"
        "from gateway.edge import asgi\n"
        "from ..app.front import x\n"
        "from . import keys\n"
        "def f():\n    import gateway\n"
        "if TYPE_CHECKING:\n    from routing.errors import Limited\n"
        "import os\n"
    )
    assert ours(imported(source, "gateway.cli.main")) == [
        "gateway.errors",
        "gateway.edge",
        "gateway.edge.asgi",
        "gateway.app.front",
        "gateway.cli.keys",
        "gateway",
        "routing.errors",
    ]


def test_an_upward_import_fails_the_check() -> None:
    source = "from gateway.completions.route import CompletionRoute\n"
    found = [package_of(n) for n in ours(imported(source, "routing.admission.admit"))]
    assert found == ["gateway.completions"]
    assert not set(found) <= MAY_IMPORT["routing.admission"]
