"""GPU memory whose physical pages come and go while its virtual address stays.

The colocated engine must give its KV cache back to the trainer after every
rollout, but its CUDA graphs hold raw pointers into that cache; re-capturing
every graph each rollout costs seconds. With the CUDA driver's virtual memory
API (through the `cuda.bindings` package) a `StableBuffer` reserves an address
range once and maps physical memory into it per session (`map`) and out again
(`unmap`, the memory is free for the trainer). The tensor view over the whole
range keeps its address and shape, so graphs captured over it stay valid;
only the first `mapped_bytes` may be touched while mapped.

`stable_buffer` returns None where the driver API is unavailable (no
cuda.bindings, or a CPU device); the engine then allocates plainly and drops its
graphs with the cache.
"""
from __future__ import annotations

import torch


class _CudaArray:
    """A raw device range in the __cuda_array_interface__ protocol, for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _ok(result):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class StableBuffer:
    def __init__(self, driver, device: torch.device, max_bytes: int):
        self.cu, self.device = driver, device
        cu = driver
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.index if device.index is not None else torch.cuda.current_device()
        self.prop = prop
        self.granularity = int(_ok(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
        self.max_bytes = self._round(max_bytes)
        self.ptr = _ok(cu.cuMemAddressReserve(self.max_bytes, 0, 0, 0))
        self.tensor = torch.as_tensor(_CudaArray(int(self.ptr), self.max_bytes), device=device)   # uint8 view
        self.handle = None
        self.mapped_bytes = 0

    def _round(self, nbytes: int) -> int:
        return -(-nbytes // self.granularity) * self.granularity

    def map(self, nbytes: int) -> None:
        """Back the first `nbytes` (rounded up to the granularity) with fresh physical memory."""
        if self.handle is not None:
            raise RuntimeError("StableBuffer.map: already mapped")
        cu, size = self.cu, self._round(nbytes)
        if size > self.max_bytes:
            raise ValueError(f"StableBuffer.map: {size} bytes exceed the reserved {self.max_bytes}")
        self.handle = _ok(cu.cuMemCreate(size, self.prop, 0))
        _ok(cu.cuMemMap(self.ptr, size, 0, self.handle, 0))
        access = cu.CUmemAccessDesc()
        access.location.type = self.prop.location.type
        access.location.id = self.prop.location.id
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _ok(cu.cuMemSetAccess(self.ptr, size, [access], 1))
        self.mapped_bytes = size

    def unmap(self) -> None:
        """Return the physical memory (nothing may still be reading the range)."""
        if self.handle is None:
            return
        torch.cuda.synchronize(self.device)
        _ok(self.cu.cuMemUnmap(self.ptr, self.mapped_bytes))
        _ok(self.cu.cuMemRelease(self.handle))
        self.handle, self.mapped_bytes = None, 0


def stable_buffer(device: torch.device, max_bytes: int) -> StableBuffer | None:
    if device.type != "cuda":
        return None
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return StableBuffer(driver, device, max_bytes)
