"""Measurement primitives of the bench: device-synchronized timing, peak memory, time guards.

Timings synchronize the device before reading clocks. Peak memory is
torch.cuda.max_memory_allocated, reset before each measurement (None on CPU).
A part runs under `time_guard`, a SIGALRM timer that raises PartTimeout in the
main thread (a no-op where SIGALRM is unavailable or off the main thread).
"""
from __future__ import annotations

import gc
import signal
import statistics
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable

import torch

OOM_ERRORS = (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else (torch.cuda.OutOfMemoryError,)


class PartTimeout(Exception):
    """A part ran past its time guard (reported as status "timeout", not "error")."""


@contextmanager
def time_guard(seconds: float):
    """Raise PartTimeout in the main thread after `seconds` (no-op where SIGALRM is unavailable)."""
    usable = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if not usable or seconds <= 0:
        yield
        return

    def fire(signum, frame):
        raise PartTimeout(f"time guard of {seconds:.0f} s reached")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def median_ms(fn: Callable[[], Any], device: torch.device, n: int) -> float:
    """Median ms of n calls of fn after one warm-up call, each timed alone: by CUDA events on a GPU
    (kernel time without the host's clock reads), by the wall clock elsewhere."""
    fn()
    times = []
    for _ in range(n):
        if device.type != "cuda":
            times.append(timed(fn, device)[1] * 1000)
            continue
        sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        sync(device)
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rate(num: float, seconds: float) -> float:
    return num / seconds if seconds > 0 else float("inf")
