"""The engine's weights in one range of device memory that can be given back while the trainer runs.

miles frees its rollout engine's weights during training when colocated (`--offload-rollout-level
kv_cache weight`, its default there) and restores them with the next weight update: for an 8B model
that is 15 GiB of an 80 GB card, beside 61 GiB of fp32 weights and gradients. Here every engine
weight (after forward.fuse_projections) is a view into one arena; `release` gives the arena's memory
back, `restore` takes it again with undefined contents, and the weight sync then overwrites every
engine parameter (weight_sync.py checks that the trainer's names cover the engine's).

On CUDA with the driver's virtual memory API the arena is a StableBuffer (stable_memory.py): its
address stays, so CUDA graphs captured over the weights stay valid. Otherwise (CPU, no
cuda.bindings) it is one plain tensor whose storage is resized to nothing and back, as FSDP2 does
with its unsharded parameters: the views keep their storage, but its address may move, so the
runner drops its graphs (`stable` says which case holds).
"""
from __future__ import annotations

import torch

from furlong.engine.stable_memory import stable_buffer

ALIGN = 512   # bytes: each tensor starts on this boundary (vector loads, cuBLAS' 16-byte minimum)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class WeightArena:
    def __init__(self, max_bytes: int, device: torch.device):
        """Room for tensors of `max_bytes` in all (each rounded up to ALIGN bytes), on `device`."""
        self.buffer = stable_buffer(device, max_bytes)
        if self.buffer is not None:
            self.buffer.map(max_bytes)
            self.bytes = self.buffer.tensor[:max_bytes]
        else:
            self.bytes = torch.empty(max_bytes, dtype=torch.uint8, device=device)
        self.max_bytes = max_bytes
        self.used = 0                  # bytes handed out by take()
        self.released = False

    @classmethod
    def for_tensors(cls, tensors: list[torch.Tensor], device: torch.device) -> WeightArena:
        """An arena that holds these tensors (or any grouping of them, e.g. concatenations: a group rounded up
        takes no more than its parts rounded up one by one)."""
        return cls(sum(_aligned(t.numel() * t.element_size()) for t in tensors), device)

    @property
    def stable(self) -> bool:
        """Whether release/restore keep the address (graphs captured over the weights stay valid)."""
        return self.buffer is not None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new contiguous tensor in the arena (undefined contents)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if self.used + nbytes > self.max_bytes:
            raise ValueError(f"WeightArena.take: {nbytes} bytes do not fit ({self.used} of {self.max_bytes} used)")
        out = self.bytes[self.used:self.used + nbytes].view(dtype).view(shape)
        self.used += _aligned(nbytes)
        return out

    def holds(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == self.bytes.untyped_storage().data_ptr()

    def release(self) -> None:
        """Give the memory back (nothing may still read the weights); their values are lost."""
        if self.released:
            return
        if self.buffer is not None:
            self.buffer.unmap()
        else:
            self.bytes.untyped_storage().resize_(0)
        self.released = True

    def restore(self) -> None:
        """Take the memory again: the weights' values are undefined until written (the weight sync)."""
        if not self.released:
            return
        if self.buffer is not None:
            self.buffer.map(self.max_bytes)
        else:
            self.bytes.untyped_storage().resize_(self.max_bytes)
        self.released = False
