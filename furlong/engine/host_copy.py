"""Host lists to device tensors without a host sync, so a prefill can be launched behind a decode window.

`torch.tensor(x, device="cuda")` copies through pageable memory and waits for the stream (PyTorch's
blocking copy synchronises it), which would stall the host until the decode window queued before
the prefill has run: the overlap a mixed step exists for (scheduler.py) would be lost. Staging
through pinned memory makes the copy asynchronous; PyTorch's caching host allocator keeps the
pinned block until the copy that reads it has run.
"""
from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[len(values)] tensor on `device`, enqueued on the current stream without waiting for it."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
