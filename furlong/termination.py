"""SIGTERM outside a training step: one line and exit 128 + 15, as inside the RL loop.

Inside the RL loop and the SFT loop, launch/signals.StopRequest turns SIGINT/SIGTERM into a stop
at the next whole step (with a final save). Everywhere else (start-up, model loading, the final
save, `furlong eval`, export, prepare) the default SIGTERM would kill the process with rc -15 and
no message; `sigterm_raises` makes it raise `Terminated` instead, which the CLI reports as one
line. Interrupting there is safe: checkpoints, HF saves, metrics rewrites and sample files are all
written to a temporary name and renamed, so what is on disk is either old or complete.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


class Terminated(BaseException):
    """SIGTERM arrived outside a step loop (a BaseException, like KeyboardInterrupt, so that no
    `except Exception` in between swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise(signum: int, frame) -> None:
    raise Terminated(signum)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises Terminated (main thread only; the old handler is restored)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def terminated_line(e: Terminated) -> str:
    return (f"furlong: stopped by signal {e.signum} ({signal.Signals(e.signum).name}) outside a training step; "
            "files already written are complete (every save is written to a temporary name, then renamed)")
