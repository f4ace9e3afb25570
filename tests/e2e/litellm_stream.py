"""LiteLLM's SDK as its users call it, in a process of its own (LiteLLM sets global state and
reads its environment at import): one streamed chat per stream_options given, printing for
each the usage LiteLLM's own chunk builder finds and the usage on its last chunk.

Usage: python litellm_stream.py <base_url> <api_key> <model> <prompt> <options JSON | absent>...
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

# No network here: LiteLLM's price map and tokenizers from the package, never fetched.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import litellm


def main(base_url: str, key: str, model: str, prompt: str, *rows: str) -> None:
    for row in rows:
        extra = {} if row == "absent" else {"stream_options": json.loads(row)}
        chunks = list(
            litellm.completion(
                model=f"openai/{model}", api_base=base_url, api_key=key, max_tokens=3,
                messages=[{"role": "user", "content": prompt}], stream=True, **extra,
            )
        )  # fmt: skip
        # LiteLLM sets a response's usage at run time: its types do not show it.
        built: Any = litellm.stream_chunk_builder(chunks)
        last = getattr(chunks[-1], "usage", None)
        print(json.dumps({
            "row": row,
            "built": built.usage.model_dump(include={"prompt_tokens", "completion_tokens"}),
            "last": None if last is None else last.model_dump(
                include={"prompt_tokens", "completion_tokens"}),
        }))  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
