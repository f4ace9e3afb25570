"""A previous revision of the gateway as a second target: its tree checked out with
`git worktree add --detach` into a temporary directory (removed at the end), run by this
checkout's venv with PYTHONPATH and cwd pointing at that tree."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "routing", "tiers")


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


@contextmanager
def checkout(rev: str) -> Iterator[tuple[Path, str]]:
    """(the tree, its full commit id) of `rev`, checked out detached in a temporary
    directory; the worktree is removed (and pruned) on the way out."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    parent = Path(tempfile.mkdtemp(prefix="bench-baseline-"))
    tree = parent / "tree"
    _git("worktree", "add", "--detach", "--quiet", str(tree), commit)
    try:
        check_imports(tree)
        yield tree, commit
    finally:
        _git("worktree", "remove", "--force", str(tree))
        parent.rmdir()


def check_imports(tree: Path) -> None:
    """The packages must load from `tree`, not from this checkout's editable install (its
    finder comes after sys.path, so PYTHONPATH wins; this makes sure of it)."""
    code = "import sys\nfor name in sys.argv[1:]:\n    print(__import__(name).__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code, *PACKAGES],
        capture_output=True, text=True, check=False, cwd=tree,
        env=dict(os.environ, PYTHONPATH=str(tree)),
    )  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"the baseline does not import: {done.stderr[-1500:]}")
    files = [Path(line) for line in done.stdout.splitlines()]
    outside = [str(f) for f in files if not f.resolve().is_relative_to(tree.resolve())]
    if len(files) != len(PACKAGES) or outside:
        sys.exit(f"the baseline's packages load from this checkout, not its tree: {outside}")
