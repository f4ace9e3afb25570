"""The repository stands alone: nothing in it points outside it.

A user has only the repo: no file may cite documents that live elsewhere, and every relative
link of the README and of docs/ must land on a file the repo holds.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Not the repo's content: version control, environments, caches, build output.
SKIPPED_DIRS = {
    ".git", ".venv", "venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache",
    ".hypothesis", "build", "dist", "node_modules",
}  # fmt: skip
# Documents that are not in the repo, and citations of them (their names in capitals before
# a section number or a colon); spelt in pieces so that this file does not name them itself.
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", r"\bSPEC" + r"\b", r"\bDESIGN" + r"\b"]))
# [text](target) and [text]: target; the target ends at whitespace or ")".
LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)[^)]*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.M)


def repo_files() -> list[Path]:
    found = []
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if any(p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parts):
            continue
        if path.is_file() and not path.is_symlink():
            found.append(path)
    return found


def text_of(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # binary: cannot cite anything


def test_the_walk_sees_the_repo() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in repo_files()}
    assert {"README.md", "docs/api.md", "gateway/cli/main.py", "tests/test_docs.py"} <= names


def test_no_file_points_outside_the_repo() -> None:
    offenders = []
    for path in repo_files():
        text = text_of(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not offenders, "files cite documents outside the repo:\n" + "\n".join(offenders)


def markdown_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(text: str) -> list[str]:
    links = [a or b for a, b in LINK.findall(_without_code(text))]
    return [link for link in links if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", link, re.I)]


def _without_code(text: str) -> str:
    """Markdown without fenced blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def test_relative_links_land_on_files_of_the_repo() -> None:
    assert len(markdown_docs()) >= 6  # README.md, docs/README.md and the documents
    broken = []
    for doc in markdown_docs():
        for link in relative_links(doc.read_text(encoding="utf-8")):
            target = (doc.parent / link.split("#", 1)[0]).resolve()
            inside = target == ROOT or ROOT in target.parents
            if not (inside and target.exists()):
                broken.append(f"{doc.relative_to(ROOT)}: {link}")
    assert not broken, "links to nothing (or outside the repo):\n" + "\n".join(broken)


def test_links_are_found() -> None:
    text = 'see [a](docs/a.md#x "title"), [web](https://x.org), [top](#t), `[c](d.md)`\n'
    text += "```\n[e](f.md)\n```\n[ref]: ../up.md\n"
    assert relative_links(text) == ["docs/a.md#x", "../up.md"]
