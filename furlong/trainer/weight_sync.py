"""Push the trainer's weights into the rollout engine's model, in place (docs/design.md §2 step 7, §6).

The trainer's parameters are FSDP2 shards (DTensors, fp32); the engine holds
its own full copy of the same Transformer in its compute dtype. Parameters are
walked in the trainer's order and grouped into buckets of about
`--update-weight-buffer-size` bytes (counted in the engine dtype); per bucket,
every rank casts its shards to the engine dtype (halving all-gather traffic for
bf16; the cast is elementwise, so cast-then-gather equals gather-then-cast),
gathers the full tensors (`full_tensor()`, a collective every rank must call in
the same order), copies them into the engine's parameters and frees them. At
most one bucket of gathered tensors is alive at a time (a single parameter
larger than the budget forms its own bucket).

Parameters are matched by name (both sides are furlong Transformers); tied
embeddings appear once on both sides, and any mismatch of names or shapes is a
ValueError before anything is gathered.
"""
from __future__ import annotations

import torch
from torch import nn


def _full(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # to the engine's device first: offloaded shards (--fsdp-cpu-offload) are CPU tensors, which an
    # NCCL all-gather cannot take
    t = t.detach().to(device=device, dtype=dtype)
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _buckets(params: list[tuple[str, torch.Tensor]], dtype: torch.dtype, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, p in params:
        nbytes = p.numel() * dtype.itemsize  # numel of a DTensor is its full (global) size
        if not out or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, p))
        size += nbytes
    return out


@torch.no_grad()
def sync_weights(actor_model: nn.Module, engine_model: nn.Module, bucket_bytes: int) -> int:
    """Copy the (sharded) trainer weights into `engine_model`'s parameters; every rank calls.

    Returns the number of bytes written into the engine (in its dtype).
    """
    if bucket_bytes < 1:
        raise ValueError(f"--update-weight-buffer-size: must be >= 1, got {bucket_bytes}")
    src = list(actor_model.named_parameters())
    dst = dict(engine_model.named_parameters())
    missing = [n for n, _ in src if n not in dst]
    extra = sorted(set(dst) - {n for n, _ in src})
    if missing or extra:
        raise ValueError(f"weight sync: trainer/engine parameter names differ "
                         f"(trainer only: {missing[:3]}, engine only: {extra[:3]})")
    for n, p in src:
        if tuple(p.shape) != tuple(dst[n].shape):
            raise ValueError(f"weight sync: {n} has shape {tuple(p.shape)} in the trainer, "
                             f"{tuple(dst[n].shape)} in the engine")
    written = 0
    dtypes = {p.dtype for p in dst.values()}
    if len(dtypes) != 1:
        raise ValueError(f"weight sync: engine parameters have mixed dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    for bucket in _buckets(src, dtype, bucket_bytes):
        gathered = [(name, _full(p, dtype, dst[name].device)) for name, p in bucket]
        for name, full in gathered:
            dst[name].copy_(full)
            written += full.numel() * full.element_size()
        del gathered
    return written
