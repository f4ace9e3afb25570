"""`gateway serve --workers N`: N processes serving one port, and their supervisor.

The parent binds the port first with SO_REUSEPORT and never listens on it: it only holds
the port (a busy port is one clear line, port 0 is chosen once). Each worker is forked from
it and binds its own listening socket to that port with SO_REUSEPORT, so the kernel spreads
new connections over the workers (by a hash of the connection; with one shared socket the
spread would be whichever process wakes first). A worker is a
whole gateway, as `serve` without `--workers` is: its own Redis connections, keeper, health
checks, config watcher and usage spool (named by its pid and a random token: routing/
spoolfile.py), and it drains as a single gateway does. The parent runs no event loop and
holds no connection; it only waits on its workers:

- a worker that ends while the parent is not stopping is forked again after RESTART_PAUSE_S
  (the spool it left is adopted by the next spool round of any process of the store, its
  leases expire as a dead replica's do); QUICK_DEATHS in a row, each within QUICK_S of its
  start, stop the whole serve with exit code 1 instead (a fault no restart mends: let the
  orchestrator see it);
- SIGTERM or SIGINT: every worker gets SIGTERM and drains; the parent exits 0 once all
  ended with 0 (else 1). A second signal gives them FORCE_SIGNAL: the requests still
  running are cut short at once. Only the parent forces: a worker may get each stop twice,
  in either order (a terminal's Ctrl-C reaches every process of the group as SIGINT, a
  service manager may signal them all, and the parent passes the stop on), and takes any
  number of SIGINT and SIGTERM as one drain;
- SIGHUP goes to every worker (each checks its config file, gateway/runtime/reload.py);
- a worker whose event loop stops turning (stopped, deadlocked, stuck in a call that never
  returns) is killed after HANG_S and forked again: the kernel would keep handing it its
  share of new connections, which would wait for ever. Each worker's loop writes a byte to
  a pipe of its own every BEAT_S; the parent waits on those pipes (a worker's end closes
  when it dies, which wakes the parent at once);
- metrics: every worker writes into one private directory (gateway/metrics.py), removed
  when the serve ends; a dead worker's live gauges are dropped, its counts stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn

from prometheus_client.multiprocess import mark_process_dead

from gateway.metrics import share_across_processes

log = logging.getLogger("gateway")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# From the parent to its workers only: stop now (a second stop signal reached the parent).
FORCE_SIGNAL = signal.SIGUSR1
HANDLED = {*STOP_SIGNALS, signal.SIGHUP}
RESTART_PAUSE_S = 1.0
QUICK_S = 10.0
QUICK_DEATHS = 3
# A worker's loop beats every BEAT_S; one silent for HANG_S (from its fork until its first
# beat: START_S, as its imports and app take a while) is stuck. GATEWAY_WORKER_HANG_S
# sets HANG_S (seconds; the tests make it short).
HANG_S = float(os.environ.get("GATEWAY_WORKER_HANG_S") or 10.0)
BEAT_S = min(1.0, HANG_S / 4)
START_S = max(30.0, HANG_S)
_beat_fd: int | None = None  # in a worker: the write end of its heartbeat pipe
_PR_SET_PDEATHSIG = 1
_Mask = set[int | signal.Signals]  # a signal mask, as pthread_sigmask gives it


@dataclass
class _Child:
    index: int
    started: float
    beats: int  # the read end of its heartbeat pipe
    heard: float  # when it last beat (its fork, before the first)
    beating: bool = False
    killed: bool = False  # as stuck, once


class Workers:
    """Runs `serve_one` (a whole gateway, until it drained) in `count` forked processes."""

    def __init__(self, count: int, serve_one: Callable[[], None]) -> None:
        self._count = count
        self._serve_one = serve_one
        self._children: dict[int, _Child] = {}
        self._stopping = False
        self._failed = False
        self._quick_deaths = 0
        self._metrics_dir = ""

    def run(self, holder: socket.socket) -> int:
        """Serve until a stop signal (or workers that cannot start); the exit code."""
        try:
            self._metrics_dir = tempfile.mkdtemp(prefix="gateway-metrics-")
        except OSError as exc:
            log.error("cannot make the workers' metrics directory: %s", exc.strerror or exc)
            return 1
        previous = {sig: signal.signal(sig, self._on_stop) for sig in STOP_SIGNALS}
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hup)
        try:
            for index in range(self._count):
                self._fork(index, holder)
            self._supervise(holder)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
        return 1 if self._failed else 0

    def _fork(self, index: int, holder: socket.socket) -> None:
        # Signals wait until the pid is known: a stop signal then reaches this worker too.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
        parent = os.getpid()
        beats, beat = os.pipe()
        try:
            pid = os.fork()
            if pid == 0:
                os.close(beats)
                self._child(holder, mask, parent, beat)
            now = time.monotonic()
            self._children[pid] = _Child(index, now, beats, now)
        finally:
            os.close(beat)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _child(self, holder: socket.socket, mask: _Mask, parent: int, beat: int) -> NoReturn:
        global _beat_fd
        code = 1
        try:
            holder.close()
            for other in self._children.values():  # the other workers' pipes are not its
                os.close(other.beats)
            os.set_blocking(beat, False)
            _beat_fd = beat
            for sig in (*STOP_SIGNALS, FORCE_SIGNAL):  # until the server takes them:
                signal.signal(sig, _exit_at_once)  # nothing to drain yet
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the config watcher takes it
            _die_with(parent)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            share_across_processes(self._metrics_dir)
            self._serve_one()
            code = 0
        except SystemExit as exc:  # uvicorn's way of saying the startup failed
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            log.exception("worker %d failed", os.getpid())
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os._exit(code)

    def _supervise(self, holder: socket.socket) -> None:
        while self._children:
            self._listen()
            while self._children:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    return
                if pid == 0:
                    break
                if (child := self._children.pop(pid, None)) is not None:
                    self._reaped(child, pid, status, holder)

    def _listen(self) -> None:
        """Wait up to a beat for the workers' heartbeats (a dead worker's pipe wakes it at
        once); kill a worker silent for too long."""
        by_fd = {child.beats: child for child in self._children.values()}
        ready, _, _ = select.select(list(by_fd), [], [], BEAT_S)
        now = time.monotonic()
        for fd in ready:
            with contextlib.suppress(OSError):
                if os.read(fd, 4096):
                    by_fd[fd].heard, by_fd[fd].beating = now, True
        for pid, child in self._children.items():
            silent = now - child.heard
            if child.killed or silent < (HANG_S if child.beating else START_S):
                continue
            log.error("worker %d has not run its event loop for %.0f s: killing it", pid, silent)
            child.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _reaped(self, child: _Child, pid: int, status: int, holder: socket.socket) -> None:
        os.close(child.beats)
        mark_process_dead(pid, self._metrics_dir)  # type: ignore[no-untyped-call]
        code = os.waitstatus_to_exitcode(status)
        if self._stopping:
            if code != 0:
                log.error("worker %d %s while draining", pid, _ended(code))
                self._failed = True
            return
        self._died(child, pid, code, holder)

    def _died(self, child: _Child, pid: int, code: int, holder: socket.socket) -> None:
        index, started = child.index, child.started
        quick = time.monotonic() - started < QUICK_S
        self._quick_deaths = self._quick_deaths + 1 if quick else 0
        if self._quick_deaths >= QUICK_DEATHS:
            log.error("worker %d %s; workers keep ending at start: stopping", pid, _ended(code))
            self._failed = True
            self._on_stop(signal.SIGTERM, None)
            return
        log.error("worker %d %s; starting another", pid, _ended(code))
        time.sleep(RESTART_PAUSE_S)  # a stop signal during the pause is handled, then on
        if not self._stopping:
            self._fork(index, holder)

    def _on_stop(self, sig: int, frame: FrameType | None) -> None:
        if self._stopping:
            self._signal_all(FORCE_SIGNAL)  # the second: cut the requests short at once
            return
        self._stopping = True
        log.info("stopping: %d workers drain", len(self._children))
        self._signal_all(signal.SIGTERM)

    def _on_hup(self, sig: int, frame: FrameType | None) -> None:
        if not self._stopping:
            self._signal_all(signal.SIGHUP)

    def _signal_all(self, sig: int) -> None:
        for pid in list(self._children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def in_worker() -> bool:
    """Whether this process is a worker of `serve --workers`."""
    return _beat_fd is not None


def start_heartbeat() -> None:
    """In a worker, as its event loop starts (gateway/edge/server.py): beat every BEAT_S from
    the loop, so that the beats stop when the loop does. Elsewhere, nothing."""
    fd = _beat_fd
    if fd is None:
        return
    loop = asyncio.get_running_loop()

    def beat() -> None:
        try:
            os.write(fd, b".")
        except BlockingIOError:
            pass  # the pipe is full: the parent reads behind, and knows the worker lives
        except OSError:
            return  # the parent is gone
        loop.call_later(BEAT_S, beat)

    beat()


def _exit_at_once(sig: int, frame: FrameType | None) -> None:
    os._exit(0)


def _die_with(parent: int) -> None:
    """SIGTERM (a drain) for this worker when its parent dies, whatever kills the parent
    (Linux; elsewhere workers outlive a parent killed with SIGKILL)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(0)


def _ended(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
