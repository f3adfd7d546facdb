"""Where the KV cache's bytes live: mapped for a generation session, given back after it.

The colocated trainer needs the memory between sessions. On CUDA with the driver's virtual memory
API the keys and values are two StableBuffers (stable_memory.py), reserved once at the device's
size: their physical memory is unmapped between sessions while their addresses stay, so the runner
keeps its CUDA graphs, decode buffers and graph pool. Otherwise (CPU, no cuda.bindings) each session
allocates plainly, and `map`/`unmap` say that graphs over the old cache must go.
"""
from __future__ import annotations

import torch

from furlong.engine.kv_cache import KVLayout, PagedKVCache
from furlong.engine.stable_memory import stable_buffer


class CacheMemory:
    def __init__(self, layout: KVLayout, device: torch.device):
        self.layout, self.device = layout, device
        self.stable: tuple | None = None      # (keys, values) StableBuffers, reserved on first use; () none

    def map(self, num_pages: int) -> tuple[PagedKVCache, bool]:
        """A cache of `num_pages` pages; -> (cache, whether its address is the previous session's)."""
        layout, dev = self.layout, self.device
        if dev.type == "cuda" and self.stable is None:
            total = torch.cuda.get_device_properties(dev).total_memory
            k = stable_buffer(dev, total)
            self.stable = (k, stable_buffer(dev, total)) if k is not None else ()
        if self.stable:
            for buf in self.stable:
                buf.map(num_pages * layout.page_bytes)
            max_pages = self.stable[0].max_bytes // layout.page_bytes
            (keys, key_scales), (values, value_scales) = (layout.views(buf.tensor, max_pages, values=i == 1)
                                                          for i, buf in enumerate(self.stable))
            if layout.dim_major(values=True):
                # the decode kernel reads a dim-major V tile whole, slots past a row's context too
                # (times a zero probability): freshly mapped memory may hold e4m3 NaN bytes, which
                # would survive that; written slots are always finite (one memset per session: by
                # bandwidth ~10 ms for a 27 GB V cache, not timed)
                self.stable[1].tensor[:num_pages * layout.page_bytes].zero_()
        else:
            # zeros: the CPU reference attention reads whole pages (masked), and a NaN bit pattern
            # left in never-written memory would survive the mask (NaN * 0)
            (keys, key_scales), (values, value_scales) = (
                layout.views(torch.zeros(num_pages * layout.page_bytes, dtype=torch.uint8, device=dev), num_pages,
                             values=i == 1) for i in range(2))
        return PagedKVCache(keys, values, key_scales, value_scales), bool(self.stable)

    def unmap(self) -> bool:
        """Give the session's memory back (nothing may still read it); -> whether addresses stay."""
        for buf in self.stable or ():
            buf.unmap()
        return bool(self.stable)
