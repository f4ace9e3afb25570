"""What a worker's /metrics says: the few vLLM (and llama.cpp) gauges the gateway reads.

One pass over the text picks the samples of the names asked for and nothing else (a vLLM's
/metrics is mostly histograms no one here reads). Odd text never raises: a line that does
not parse is skipped, a value that is not a finite number is no value, and sizes are held
to bounds; the caller bounds the text's length (routing/hop/health.py).

llama.cpp's llama-server tells no KV-cache size in its /metrics: its `/props` does (each
slot's `n_ctx`, and `total_slots`), read beside them for `auto` (`props_tokens`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import orjson

# vLLM's queue, and llama.cpp's (requests no slot took yet).
WAITING = ("vllm:num_requests_waiting", "llamacpp:requests_deferred")
# What a llama-server's /metrics lines start with: its cache's size is in /props.
LLAMA = "llamacpp:"
# vLLM renamed its KV-cache gauge; both are read (the first found wins).
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# An info gauge (value 1): the cache's shape in its labels, one sample per engine of a
# data-parallel worker (label `engine`).
CACHE_CONFIG = "vllm:cache_config_info"
LOAD = (*WAITING, *KV_USAGE)
# The largest budget a worker may report: the config's bound on `max_tokens_in_flight`.
MAX_TOKENS = 1_000_000_000
# Digits of a block count or size worth reading (beyond, a number is nonsense).
_MAX_DIGITS = 12
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class Reading:
    """One probe's reading of a worker; None: not asked for, or not in its /metrics."""

    waiting: float | None = None  # requests queued in the worker
    kv_usage: float | None = None  # its KV cache in use, 0 to 1
    kv_tokens: int | None = None  # its KV cache in tokens: num_gpu_blocks x block_size


def read(text: str, *, load: bool, cache: bool, props: str | None = None) -> Reading:
    """The worker's queue and KV-cache use (`load`) and its KV cache's size (`cache`: from
    vLLM's /metrics, else from llama.cpp's /props, when given)."""
    names = set(LOAD if load else ()) | ({CACHE_CONFIG} if cache else set())
    samples = _samples(text, names)
    tokens = _cache_tokens(samples.get(CACHE_CONFIG, [])) if cache else None
    if cache and tokens is None and props is not None:
        tokens = props_tokens(props)
    return Reading(
        _sum(samples, WAITING) if load else None,
        _sum(samples, KV_USAGE) if load else None,
        tokens,
    )


def props_tokens(text: str) -> int | None:
    """llama.cpp's KV cache in tokens, from its /props: each slot's context (`n_ctx` of
    `default_generation_settings`) times `total_slots`; None when it does not say."""
    try:
        props: Any = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    if not isinstance(settings, dict):
        return None
    n_ctx, slots = _positive(settings.get("n_ctx")), _positive(props.get("total_slots"))
    if n_ctx is None or slots is None:
        return None
    return min(MAX_TOKENS, n_ctx * slots)


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def gauge(text: str, names: tuple[str, ...]) -> float:
    """The sum of a gauge's samples over its label sets (first name found wins; 0 if none)."""
    found = _sum(_samples(text, set(names)), names)
    return 0.0 if found is None else found


def _samples(text: str, names: Collection[str]) -> dict[str, list[tuple[str, float]]]:
    """The samples of `names`: (their label text, their value), in the text's order."""
    found: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        if not line.startswith(("vllm:", LLAMA)):
            continue
        end = len(line)
        for stop in ("{", " ", "\t"):
            at = line.find(stop)
            end = at if 0 <= at < end else end
        name = line[:end]
        if name in names and (sample := _sample(line[end:])) is not None:
            found.setdefault(name, []).append(sample)
    return found


def _sample(rest: str) -> tuple[str, float] | None:
    """`{labels} value [timestamp]` or ` value [timestamp]`; None when it does not parse."""
    labels = ""
    if rest.startswith("{"):
        close = _closing_brace(rest)
        if close < 0:
            return None
        labels, rest = rest[1:close], rest[close + 1 :]
    fields = rest.split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return (labels, value) if math.isfinite(value) else None


def _closing_brace(text: str) -> int:
    """Where the label set that opens `text` closes (braces inside quotes do not count)."""
    quoted = escaped = False
    for i, char in enumerate(text):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = quoted
        elif char == '"':
            quoted = not quoted
        elif char == "}" and not quoted:
            return i
    return -1


def _sum(samples: dict[str, list[tuple[str, float]]], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in samples:
            total = sum(value for _, value in samples[name])
            return total if math.isfinite(total) else None
    return None


def _cache_tokens(samples: list[tuple[str, float]]) -> int | None:
    """The KV cache in tokens: num_gpu_blocks x block_size, summed over the engines (each
    has a cache of its own; the last sample of an engine counts); None when no sample
    tells it (vLLM says `num_gpu_blocks="None"` before it has measured its memory)."""
    per_engine: dict[str, int] = {}
    for labels, value in samples:
        if value == 0:  # an info gauge is 1; 0 would be a shape no longer in force
            continue
        found = dict(_LABEL.findall(labels))
        blocks, size = _count(found.get("num_gpu_blocks")), _count(found.get("block_size"))
        if blocks is not None and size is not None:
            per_engine[found.get("engine", "")] = blocks * size
    if not per_engine:
        return None
    return min(MAX_TOKENS, sum(per_engine.values()))


def _count(text: str | None) -> int | None:
    if text is None or not text.isascii() or not text.isdigit() or len(text) > _MAX_DIGITS:
        return None
    number = int(text)
    return number if number > 0 else None
