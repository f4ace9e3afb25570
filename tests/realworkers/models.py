"""The tiny model the real workers serve, made by the tests (this machine reaches no model
hub) with the model kit of .ci/real-workers, and cached beside the servers under a hash of
its recipe and of the script that makes it: a second run makes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.realworkers.servers import workers_dir

BUILDER = Path(__file__).with_name("tinymodel.py")
# A random-weight Llama: 2 layers, hidden 128 (two heads of 64, a size every CPU attention
# kernel takes), about 1,000 tokens of vocabulary. The context is what llama.cpp allows a
# slot at most (it caps a slot at the trained length); vLLM is served with less.
RECIPE = {
    "seed": 40,
    "vocab_size": 1024,
    "hidden": 128,
    "intermediate": 256,
    "layers": 2,
    "heads": 2,
    "context": 8192,
}


def recipe_key() -> str:
    text = json.dumps(RECIPE, sort_keys=True).encode() + BUILDER.read_bytes()
    return hashlib.sha256(text).hexdigest()[:16]


def tiny_model(modelkit: Path) -> Path:
    """The folder holding `hf/` (for vLLM) and `model.gguf` (for llama.cpp), made once."""
    dest = workers_dir().parent / "models" / f"tiny-llama-{recipe_key()}"
    if (dest / ".made").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=dest.parent, prefix=dest.name + ".tmp."))
    try:
        made = subprocess.run(
            [str(modelkit), str(BUILDER), str(work), json.dumps(RECIPE)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )
        if made.returncode != 0:
            raise RuntimeError(f"making the tiny model failed: {made.stderr[-3000:]}")
        (work / ".made").touch()
        if not (dest / ".made").is_file():  # two runs at once: the first to finish wins
            shutil.rmtree(dest, ignore_errors=True)
            work.rename(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest
