"""The walk goes one way: gateway/ calls into routing/ and tiers/, never the reverse.

routing/ and tiers/ raise their own errors as data (routing/errors.py); the gateway decides
what the caller sees. An import of gateway/ from below would let HTTP leak downwards again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOWER = ("routing", "tiers")


def imported(source: str, package: tuple[str, ...]) -> list[str]:
    """Every module `source` imports, absolute (relative ones resolved from `package`)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            names.append(".".join([*base, *([node.module] if node.module else [])]))
    return names


def upward(names: list[str]) -> list[str]:
    return [n for n in names if n == "gateway" or n.startswith("gateway.")]


MODULES = sorted(p for top in LOWER for p in (ROOT / top).rglob("*.py"))


def test_the_lower_packages_are_found() -> None:
    assert {p.parent.name for p in MODULES} >= set(LOWER)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_routing_and_tiers_import_nothing_from_gateway(path: Path) -> None:
    package = path.relative_to(ROOT).parent.parts
    found = upward(imported(path.read_text(encoding="utf-8"), package))
    assert found == [], f"{path.relative_to(ROOT)} imports {found}"


def test_every_form_of_an_upward_import_is_seen() -> None:
    source = (
        "import gateway.errors\n"
        "from gateway import asgi\n"
        "from ..gateway.answer import x\n"
        "def f():\n    import gateway\n"
        "from routing.errors import Limited\n"
    )
    assert upward(imported(source, ("routing",))) == [
        "gateway.errors",
        "gateway",
        "gateway.answer",
        "gateway",
    ]
