"""The supervisor of `serve --workers N` (gateway/edge/workers.py), forking this test process.

Each worker here is a stand-in for a gateway that reports over a pipe (`s<pid>` when it
serves, `h` on SIGHUP, `t` on SIGTERM, then it returns as a drained gateway does), so the
test waits on events, never on time. tests/e2e/test_workers.py runs real gateways.
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator

import pytest

from gateway.edge import workers
from gateway.edge.workers import Workers


@pytest.fixture
def holder() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock


@pytest.fixture(autouse=True)
def no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers, "RESTART_PAUSE_S", 0.0)


class Reports:
    """The workers' pipe, read by a thread of the parent (whose main thread is in `run`)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.seen: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def worker(self) -> None:
        """A gateway stand-in: serves until SIGTERM, reporting each step."""
        watched = {signal.SIGTERM, signal.SIGHUP}
        signal.pthread_sigmask(signal.SIG_BLOCK, watched)
        os.write(self.write_fd, f"s{os.getpid()}\n".encode())
        while signal.sigwait(watched) != signal.SIGTERM:
            os.write(self.write_fd, b"h\n")
        os.write(self.write_fd, b"t\n")

    def _read(self) -> None:
        with os.fdopen(self.read_fd, "rb", buffering=0) as pipe:
            for line in iter(pipe.readline, b""):
                with self._changed:
                    self.seen.append(line.decode().strip())
                    self._changed.notify_all()

    def wait(self, check: Callable[[list[str]], bool]) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: check(self.seen), timeout=20), self.seen

    def started(self) -> list[int]:
        return [int(s[1:]) for s in self.seen if s.startswith("s")]

    def close(self) -> None:
        os.close(self.write_fd)
        self._thread.join(timeout=5)


@pytest.fixture
def reports() -> Iterator[Reports]:
    made = Reports()
    try:
        yield made
    finally:
        made.close()


def in_thread(steps: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=steps, daemon=True)
    thread.start()
    return thread


def test_a_stop_signal_drains_every_worker_and_sighup_reaches_each(
    holder: socket.socket, reports: Reports
) -> None:
    def operator() -> None:
        reports.wait(lambda seen: len(reports.started()) == 2)
        os.kill(os.getpid(), signal.SIGHUP)  # to the parent, as `kill -HUP` would
        reports.wait(lambda seen: seen.count("h") == 2)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = in_thread(operator)
    assert Workers(2, reports.worker).run(holder) == 0
    thread.join(timeout=5)
    assert sorted(s[0] for s in reports.seen) == ["h", "h", "s", "s", "t", "t"]


def test_a_worker_that_dies_is_started_again(holder: socket.socket, reports: Reports) -> None:
    def operator() -> None:
        reports.wait(lambda seen: len(reports.started()) == 2)
        os.kill(reports.started()[0], signal.SIGKILL)
        reports.wait(lambda seen: len(reports.started()) == 3)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = in_thread(operator)
    assert Workers(2, reports.worker).run(holder) == 0
    thread.join(timeout=5)
    assert len(set(reports.started())) == 3
    assert reports.seen.count("t") == 2  # the two alive at the end drained


def test_workers_that_keep_dying_at_start_end_the_serve_with_1(holder: socket.socket) -> None:
    def fails() -> None:
        raise RuntimeError("cannot start")

    assert Workers(2, fails).run(holder) == 1


def test_the_metrics_directory_is_gone_after_the_serve(
    holder: socket.socket, monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR is read again

    def fails() -> None:
        raise RuntimeError("cannot start")

    Workers(1, fails).run(holder)
    assert list(os.scandir(tmp_path)) == []


def test_no_place_for_the_metrics_files_is_one_line_and_exit_code_1(
    holder: socket.socket, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/gateway-test")
    assert Workers(2, lambda: None).run(holder) == 1
    assert "metrics directory" in caplog.text
