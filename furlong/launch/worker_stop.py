"""SIGINT/SIGTERM to a launcher that spawned its own workers (launch_local): forward, wait bounded, kill.

Launcher side (`ParentStop`): the first SIGINT or SIGTERM is forwarded to every live worker as SIGTERM
(a worker in the RL or SFT loop then stops after its current step and saves, launch/signals.py; one
outside a step raises termination.Terminated and exits 128 + 15 with its line) and opens a grace
period of `grace_s`; a second signal closes it at once. Workers still alive when it closes are
SIGKILLed, and every worker is reaped before the launcher returns. A kill cannot leave a half-written
checkpoint visible: a save writes `iter_N.tmp/`, renames it and then replaces the tracker file
(checkpoint/store.py), so the tracker names the previous complete checkpoint until the new one is whole.

Worker side (`exit_with_parent`): a launcher that is itself SIGKILLed (an orchestrator whose own grace
ran out) forwards nothing, so each worker watches its parent and, once it is gone, stops the same way:
SIGTERM to itself, then exit after PARENT_GONE_GRACE_S. No worker outlives its launcher by more.

Outcome: launch_local raises WorkersStopped when the launcher was signalled and the workers did not
all finish (exit 0); launch/entry.py turns it into one line and exit 128 + signal.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import threading
import time
from contextlib import contextmanager
from types import FrameType
from typing import Iterator, Sequence

# How long the launcher waits, after the first signal, for its workers to stop (seconds). A stop waits
# for the current step and its save; orchestrators that want it sooner SIGKILL the launcher (Kubernetes
# and Slurm after 30 s by default), which exit_with_parent covers.
STOP_GRACE_S = 120.0
PARENT_GONE_GRACE_S = 10.0   # a worker whose launcher died: time for its step loop to stop, seconds
POLL_S = 0.5                 # the launcher re-checks the grace deadline this often while it waits
STOPPED_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)   # exit codes of a worker that stopped as asked


class WorkersStopped(Exception):
    """The launcher was signalled and its workers stopped (or were killed) before the run finished.
    `worker_line`: the lowest rank's own stop line (a worker stopped outside a step), if any;
    `workers_printed`: every worker stopped in its step loop, whose rank 0 printed the line already."""

    def __init__(self, signum: int, num_killed: int, grace_s: float, worker_line: str | None,
                 workers_printed: bool):
        super().__init__(f"stopped by signal {signum}")
        self.signum, self.num_killed, self.grace_s = signum, num_killed, grace_s
        self.worker_line, self.workers_printed = worker_line, workers_printed


class ParentStop:
    """The launcher's signal state: which signal came first, until when to wait, whom it told."""

    def __init__(self, procs: Sequence[mp.Process], grace_s: float = STOP_GRACE_S):
        self.procs, self.grace_s = procs, grace_s
        self.signum: int | None = None
        self.deadline: float | None = None   # time.monotonic() after which live workers are killed
        self._told: set[int] = set()         # pids already sent SIGTERM (a second one would interrupt
                                             # a worker's own stop handling)

    @contextmanager
    def installed(self) -> Iterator["ParentStop"]:
        """SIGINT/SIGTERM handled here within the block (main thread only); old handlers restored."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self.deadline = signum, time.monotonic() + self.grace_s
        else:
            self.deadline = time.monotonic()   # a second signal: wait no longer
        self.forward()

    def forward(self) -> None:
        """SIGTERM to every started, live worker not told yet (also called after start-up, for workers
        started after the signal came). SIGTERM, not SIGINT: a terminal's Ctrl-C reaches the workers
        directly too, and a second SIGINT would force them down mid-step."""
        if self.signum is None:
            return
        for p in self.procs:
            if p.pid is not None and p.pid not in self._told and p.exitcode is None:
                self._told.add(p.pid)
                os.kill(p.pid, signal.SIGTERM)

    def wait_timeout(self) -> float:
        """How long the launcher may block before it must look at the deadline again."""
        if self.deadline is None:
            return POLL_S
        return max(0.0, min(POLL_S, self.deadline - time.monotonic()))

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def kill(self, alive: Sequence[mp.Process]) -> int:
        """SIGKILL the workers still running (the grace is over); how many were."""
        left = [p for p in alive if p.exitcode is None]
        for p in left:
            p.kill()
        return len(left)

    def outcome(self, reports: list[tuple[int, int, str, bool]], num_killed: int) -> WorkersStopped | None:
        """What the launcher reports for a signalled run; None when every worker finished anyway."""
        if self.signum is None or all(p.exitcode == 0 for p in self.procs):
            return None
        stop_lines = sorted((r[0], r[2]) for r in reports if r[1] >= 128)
        printed = not reports and num_killed == 0 and all(p.exitcode in STOPPED_CODES for p in self.procs)
        return WorkersStopped(self.signum, num_killed, self.grace_s, stop_lines[0][1] if stop_lines else None,
                              printed)


def exit_with_parent(grace_s: float = PARENT_GONE_GRACE_S) -> None:
    """In a spawned worker: when the launcher process dies, stop this one too (module docstring)."""
    parent = mp.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        mp_connection.wait([parent.sentinel])   # readable once the launcher is gone
        os.kill(os.getpid(), signal.SIGTERM)    # the step loop's safe stop, as if forwarded
        time.sleep(grace_s)
        os._exit(128 + signal.SIGKILL)

    threading.Thread(target=watch, name="furlong-exit-with-parent", daemon=True).start()
