"""Causal attention over a packed row: samples concatenated, bounded by cu_seqlens.

Implementations, picked in `select_packed_impl` (the one place):
  "varlen_gqa": flash-attention 2 with the K/V heads as they are (GQA inside the kernel): torch's
                varlen_attn where it takes `enable_gqa`, else (torch 2.11) the aten flash op it
                wraps, which takes fewer K/V heads and has its own backward. Used on CUDA with
                bf16/fp16.
  "varlen":     torch.nn.attention.varlen.varlen_attn with K/V heads expanded to the query's
                (the caller expands them, see packed_kv_repeat): where the above is missing.
  "per_sample": scaled_dot_product_attention(is_causal=True) on each sample's
                segment in turn; the CPU/fp32 path and the exact reference.
Attention never crosses a sample boundary in any. The varlen signature
changed across torch versions; it is inspected once, when first needed: newer versions
take `window_size=(-1, 0)` for causal (and may take `enable_gqa`), torch 2.9/2.10
take `is_causal=True`.
Why GQA in the kernel: expanded K/V cost a copy of K and V forward and, backward, a reduction of
the expanded gradients that ran at a quarter of the memory bandwidth (52 ms of the seed step's
1.4 s train step on the H200, BENCHMARKS.md); the kernel reads each K/V head once per group.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Callable

import torch
import torch.nn.functional as F


def _probe_varlen() -> tuple[Callable | None, dict, bool]:
    """(varlen_attn or None, causal kwargs, supports enable_gqa) for this torch."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, {}, False
    try:
        params = inspect.signature(varlen_attn).parameters
    except (TypeError, ValueError):
        return None, {}, False
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None, {}, False
    if "scale" not in params:
        return None, {}, False
    return varlen_attn, causal, "enable_gqa" in params


@functools.lru_cache(maxsize=None)
def _varlen_kernel() -> tuple[Callable | None, dict, bool]:
    """_probe_varlen, once per process and only when first needed: importing
    torch.nn.attention.varlen loads dynamo, about 3 s that CPU runs never need."""
    return _probe_varlen()


@functools.lru_cache(maxsize=None)
def _flash_op() -> Callable | None:
    """aten's flash-attention forward (the op varlen_attn wraps), when this torch build has it."""
    return getattr(torch.ops.aten, "_flash_attention_forward", None)


def expand_kv(x: torch.Tensor, num_groups: int, head_dim_axis: int) -> torch.Tensor:
    """Repeat each KV head `num_groups` times along axis `head_dim_axis` (GQA -> MHA)."""
    if num_groups == 1:
        return x
    return x.repeat_interleave(num_groups, dim=head_dim_axis)


def _per_sample(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = expand_kv(k, groups, 1), expand_kv(v, groups, 1)
    # .tolist() syncs with the device; this path runs on CPU (or as a test reference).
    bounds = cu_seqlens.tolist()
    out = torch.zeros_like(q)   # positions past cu_seqlens[-1] (if any) stay 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        seg = lambda t: t[start:end].transpose(0, 1)     # [H, L, D]
        o = F.scaled_dot_product_attention(seg(q), seg(k), seg(v), is_causal=True)
        out[start:end] = o.transpose(0, 1)
    return out


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    fn, causal, _ = _varlen_kernel()
    groups = q.shape[1] // k.shape[1]
    k, v = expand_kv(k, groups, 1), expand_kv(v, groups, 1)   # no-ops when the caller expanded them
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=1.0 / math.sqrt(q.shape[-1]), **causal)


def _varlen_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    fn, causal, has_gqa = _varlen_kernel()
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if q.shape[1] == k.shape[1]:
        return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, **causal)
    if has_gqa:
        return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, enable_gqa=True, **causal)
    # positional: dropout_p 0, is_causal, no debug mask; output 0 of (out, lse, rng state, ...);
    # autograd differentiates it through aten's _flash_attention_backward
    return _flash_op()(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True, False, scale=scale)[0]


_PACKED_IMPLS: dict[str, Callable[..., torch.Tensor]] = {
    "varlen_gqa": _varlen_gqa, "varlen": _varlen, "per_sample": _per_sample}


def _available(name: str) -> bool:
    if name == "per_sample":
        return True
    fn, _, has_gqa = _varlen_kernel()
    return fn is not None and (name == "varlen" or has_gqa or _flash_op() is not None)


def select_packed_impl(q: torch.Tensor) -> str:
    """The fastest exact implementation available for this tensor."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        for name in ("varlen_gqa", "varlen"):
            if _available(name):
                return name
    return "per_sample"


def packed_kv_repeat(x: torch.Tensor, num_groups: int) -> int:
    """How many times the caller should repeat K/V heads before `packed_attention` on tensors like
    x: num_groups for the "varlen" kernel without GQA (the expansion is then fused upstream rather
    than a separate copy here), else 1 (the kernel or the per-sample path handles GQA itself)."""
    if num_groups > 1 and select_packed_impl(x) == "varlen":
        return num_groups
    return 1


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, impl: str | None = None) -> torch.Tensor:
    """Causal attention within each packed sample.

    q [T, Hq, D], k/v [T, Hkv, D] (Hq a multiple of Hkv); cu_seqlens [N+1] int32
    sample boundaries with cu_seqlens[-1] == T; returns [T, Hq, D].
    `impl` forces one of _PACKED_IMPLS (tests); default: `select_packed_impl`.
    """
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    name = impl or select_packed_impl(q)
    if name not in _PACKED_IMPLS:
        raise ValueError(f"packed attention impl {name!r} unknown (choose from {sorted(_PACKED_IMPLS)})")
    if not _available(name):
        raise ValueError(f"packed attention impl {name!r} needs torch.nn.attention.varlen.varlen_attn "
                         "(and, for GQA, its enable_gqa or aten._flash_attention_forward)")
    return _PACKED_IMPLS[name](q, k, v, cu_seqlens, max_seqlen)
