"""Toy workers and a toy launcher for tests/test_worker_stop.py: `python tests/workers_for_stop_tests.py
PID_DIR GRACE_S MODE` runs launch_local with two workers that write their pid and wait forever;
MODE "ignore": the workers ignore SIGTERM (so only the launcher's kill ends them), "plain": they
keep the handlers launch_local gives them. On WorkersStopped it prints entry.stopped_line and exits
128 + signal, as `furlong train` does."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def wait_forever(pid_dir: str, ignore_sigterm: bool) -> int:
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (Path(pid_dir) / f"{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)


def rank_1_fails(pid_dir: str) -> int:
    """Rank 1 raises a user error; rank 0 waits in Python (where SIGTERM is handled at once) until the
    launcher terminates it."""
    if os.environ["RANK"] == "1":
        while not (Path(pid_dir) / "0.pid").exists():   # rank 0 is in its function, handlers installed
            time.sleep(0.01)
        raise ValueError("--lr: rank 1 says no")
    wait_forever(pid_dir, False)
    return 0


def main(pid_dir: str, grace_s: str, mode: str) -> int:
    from furlong.config import Config
    from furlong.launch.distributed import launch_local
    from furlong.launch.entry import stopped_line
    from furlong.launch.worker_stop import WorkersStopped
    try:
        return launch_local(wait_forever, 2, pid_dir, mode == "ignore", stop_grace_s=float(grace_s))
    except WorkersStopped as e:
        line = stopped_line("train", Config(), e)
        if line is not None:
            print(line, file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
