"""The hop's settings (`upstream:` in the config). The gateway posts to workers through
routing/hop/client.py (pooled HTTP/1.1 on httptools), which replaced an aiohttp client:
a quarter less gateway CPU per request (bench/README.md)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class UpstreamSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    connect_timeout_s: float = Field(5.0, gt=0)
    # Longest silence allowed between two bytes of a worker's answer (time to first token
    # of a long prompt included), not a cap on the whole generation.
    read_timeout_s: float = Field(600.0, gt=0)
    # Largest non-streamed answer accepted from a worker.
    max_response_bytes: int = Field(64 * 1024 * 1024, ge=1024)


# How long an idle keep-alive connection to a worker is kept: below the 5 s after which
# uvicorn-based workers (vLLM, SGLang) close theirs, so the gateway closes first.
KEEPALIVE_S = 4.0
