"""The Node `openai` package's tutorial loop against the gateway (`for await (const chunk of
stream) chunk.choices[0].delta.content`): it runs to the end for every row of the stream
usage table but OpenAI's own form (whose usage chunk its users skip), and finds the usage
where the row says. The package is installed by .ci/node-clients (pinned, cached)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import KEY, Fleet

HERE = Path(__file__).parent
REPO = HERE.parents[1]
ROWS = {
    "absent": "absent",
    "empty": "{}",
    "openai": '{"include_usage": true}',
    "none": '{"include_usage": false}',
}


@pytest.fixture(scope="module")
def node_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The script beside a node_modules of the pinned clients (ESM resolves from there)."""
    done = subprocess.run(
        [str(REPO / ".ci" / "node-clients")], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        reason = f"the Node clients are not installed: {done.stderr.strip()}"
        if done.returncode == 75 and not os.environ.get("GATEWAY_CI"):
            pytest.skip(reason)
        pytest.fail(reason)
    folder = tmp_path_factory.mktemp("node")
    (folder / "node_modules").symlink_to(Path(done.stdout.strip()) / "node_modules")
    shutil.copy(HERE / "node" / "stream_usage.mjs", folder)
    return folder / "stream_usage.mjs"


def run(script: Path, base_url: str, options: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        ["node", str(script), base_url, KEY, options], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize("row", ROWS)
def test_the_node_tutorial_loop_survives(node_script: Path, fleet: Fleet, row: str) -> None:
    expected = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    for stream in run(node_script, fleet.base_url, ROWS[row]):
        assert len(stream["text"].split()) == 3, stream
        usage = stream["usage"]
        shown = [i for i, u in enumerate(usage) if u is not None]
        if row == "none":
            assert shown == []
        else:
            assert shown == [len(usage) - 1], stream
            assert usage[-1] == expected
