"""Seconds a span of device work takes (`perf/optimizer_step_time`), without a host wait where it ends.

On CUDA two timing events bracket the span and are read later, once the work is done anyway (a train
step's metrics are read after its last optimizer step): the host's clock would time only the kernel
launches of an asynchronous step. On the CPU the work is synchronous and the host's clock times it.
"""
from __future__ import annotations

import time

import torch


class DeviceTimer:
    def __init__(self, device: torch.device):
        """Starts the span: work queued on `device`'s current stream from here on counts."""
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._t = [time.perf_counter(), 0.0]

    def stop(self) -> DeviceTimer:
        if self.cuda:
            self._events[1].record()
        else:
            self._t[1] = time.perf_counter()
        return self

    def seconds(self) -> float:
        """The span's seconds; on CUDA this waits for its end (call it once the step's results are read)."""
        if not self.cuda:
            return self._t[1] - self._t[0]
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1000.0   # elapsed_time: milliseconds
