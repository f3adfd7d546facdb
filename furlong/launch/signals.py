"""SIGINT / SIGTERM during a run: stop at the next safe point instead of dying mid-step.

The first signal only sets a flag; the RL loop checks it after each rollout (all
ranks agree with one max all-reduce, so every rank stops after the same
rollout), saves a final checkpoint when --save is set and exits 128 + signal.
A second SIGINT raises KeyboardInterrupt at once (the CLI prints one line).
Handlers are installed only in the main thread and restored on exit.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType

import torch


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def agreed(self, world_size: int, device: torch.device) -> int | None:
        """The signal number if any rank was asked to stop (a collective when world_size > 1)."""
        if world_size == 1:
            return self.signum
        flag = torch.tensor([self.signum or 0], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item()) or None
