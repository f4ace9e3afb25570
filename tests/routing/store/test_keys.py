"""Every key in Redis is declared once (routing/store/keys.py): the scripts name a model's
keys from that table only, every key it declares is used, no module spells a key of its
own, and docs/architecture.md shows the table as it is."""

from __future__ import annotations

import ast
import re
from importlib import resources
from pathlib import Path

from routing.admission.slots import ModelSlots
from routing.admission.timing import Timing
from routing.store import keys
from routing.store.scripts import Scripts
from tiers.policy import BY_RANK, Tier

ROOT = Path(__file__).resolve().parents[3]
LUA = resources.files("routing.store").joinpath("lua")
SOURCES = {p.name: p.read_text(encoding="utf-8") for p in LUA.iterdir() if p.name.endswith(".lua")}
MADE = re.compile(r"BASE \.\. '([^']*)'")


def test_a_script_makes_only_the_names_the_table_declares_per_call() -> None:
    """A model's keys come from the table (`-- @keys`); what a script still makes itself
    is one of the names made per call (a tier's or an account's), nothing else."""
    made = {name for text in SOURCES.values() for name in MADE.findall(text)}
    declared = {key.name.partition("<")[0] for key in keys.MODEL_MADE}
    assert made == declared


def test_every_key_the_table_declares_is_used_by_a_script() -> None:
    """No declared key that no script touches (the table once listed `freed`, which none
    did, and lacked `held`, which the fair share writes)."""
    code = "\n".join(SOURCES.values())
    for key in keys.MODEL[1:]:
        assert re.search(rf"\b{key.name.upper()}\b", code), key.name
    assert re.search(r"\bCHANNEL\b", code)


def test_the_prelude_binds_every_declared_name() -> None:
    sweep = Scripts().sources()["sweep"]
    for key in keys.MODEL[1:]:
        assert f"{key.name.upper()} = BASE .. '{key.name}'" in sweep, key.name
    assert "-- @keys" not in sweep and "-- @key-names" not in sweep


def test_no_script_spells_a_key_outside_its_model() -> None:
    """Keys outside the model's tag reach a script as KEYS, or (the account's count, on
    one Redis) from the table's prefix."""
    for name, text in SOURCES.items():
        assert not re.search(r"'gw:|\"gw:|'\{usage\}", text), name


def test_no_module_spells_a_key_of_its_own() -> None:
    """Every "gw:..." or "{usage}..." string of the gateway's code is in the table's
    module."""
    found = []
    for top in ("gateway", "routing", "tiers"):
        for path in (ROOT / top).rglob("*.py"):
            if path == ROOT / "routing" / "store" / "keys.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                value = node.value if isinstance(node, ast.Constant) else None
                if isinstance(value, str) and value.startswith(("gw:", "{usage}")):
                    found.append(f"{path.relative_to(ROOT)}: {value!r}")
    assert found == []


def test_a_cluster_is_given_every_declared_key_of_the_model() -> None:
    """On a Cluster a script is passed every key it touches of the model (a node handing
    a slot on checks those before the script runs)."""
    utilization = dict.fromkeys(Tier, 1.0)
    model = ModelSlots("m", utilization, 10, Timing(30_000, 2_000, 3_000), declare_all=True)
    model.set_endpoints([("http://a:8000", 1, 0.0)])
    _, passed, _ = model.acquire("l1", Tier.DEFAULT, may_wait=True)
    assert list(passed) == keys.model_keys("m") == [f"gw:v2:{{m}}:{k.name}" for k in keys.MODEL]


def test_the_prelude_counts_the_tiers_of_the_tier_table() -> None:
    """The acquire's common case reads every tier's waiters in one call, however many."""
    acquire = Scripts().sources()["acquire"]
    assert keys.lua_tiers(len(BY_RANK)) in acquire and "-- @tiers" not in acquire
    assert (
        keys.lua_tiers(4) == "local RANKS = 4\nlocal WAIT_FIELDS = {'~w0', '~w1', '~w2', '~w3'}\n"
    )


def test_the_docs_show_the_table_as_it_is() -> None:
    """docs/architecture.md's "Keys in Redis" is `python -m routing.store.keys`."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    shown = text.split("<!-- keys:begin -->\n", 1)[1].split("<!-- keys:end -->", 1)[0]
    assert shown == keys.markdown()
