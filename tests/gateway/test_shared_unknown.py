"""`serve --workers N`: a worker that has not read an `auto` token budget yet (one just
started again after a kill) must not hide, on the shared /metrics, the budget another live
worker read: its "not known yet" NaN loses to any value a worker knows, and shows only
while no worker knows one."""

from __future__ import annotations

import math
import os
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import Metrics, share_across_processes
from gateway.runtime.state import show_budget


def in_worker(directory: Path, budget: int | None, render: bool = False) -> bytes:
    """Run as a forked worker of one shared directory: show `budget`, maybe render."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read)
            share_across_processes(str(directory))
            metrics = Metrics()
            show_budget(metrics, "m", "http://w", budget)
            os.write(write, metrics.render() if render else b"")
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as out:
        text = out.read()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    return text


def budget_shown(text: bytes) -> float | None:
    for family in text_string_to_metric_families(text.decode()):
        if family.name == "gateway_token_budget":
            return family.samples[0].value if family.samples else None
    return None


def test_a_budget_not_read_yet_does_not_hide_one_another_worker_read(tmp_path: Path) -> None:
    in_worker(tmp_path, 4096)
    shown = budget_shown(in_worker(tmp_path, None, render=True))  # started after it
    assert shown == 4096


def test_a_budget_no_worker_read_is_nan(tmp_path: Path) -> None:
    shown = budget_shown(in_worker(tmp_path, None, render=True))
    assert shown is not None and math.isnan(shown)
