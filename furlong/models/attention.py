"""Causal attention over a packed row: samples concatenated, bounded by cu_seqlens.

Two implementations, picked in `select_packed_impl` (the one place):
  "flash":      aten's flash-attention 2 varlen forward (the op torch's varlen_attn wraps), with the
                K/V heads as they are: GQA inside the kernel, which reads each K/V head once per
                group (torch 2.11's varlen_attn has no `enable_gqa`; expanded K/V cost a copy forward
                and, backward, a reduction of the expanded gradients: 52 ms of a 1.4 s seed train
                step on the H200, BENCHMARKS.md). Autograd goes through aten's flash backward.
                CUDA with bf16/fp16.
  "per_sample": scaled_dot_product_attention(is_causal=True) on each sample's segment in turn; the
                CPU/fp32 path and the exact reference.
Attention never crosses a sample boundary in either.

Both are single ops to torch.compile, so a whole decoder layer compiles into one graph around them
(trainer/fsdp.py: compile_layers): the flash op has aten's meta kernel and inductor fallback; the
per-sample loop (it reads cu_seqlens on the host) is wrapped as the custom op
`furlong::packed_attention_ref`, with its own backward op, so compile treats it as opaque too.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

# (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens [N+1] int32, max_seqlen, scale) -> [T, Hq, D]
PackedAttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def expand_kv(x: torch.Tensor, num_groups: int, head_dim_axis: int) -> torch.Tensor:
    """Repeat each KV head `num_groups` times along axis `head_dim_axis` (GQA -> MHA)."""
    if num_groups == 1:
        return x
    return x.repeat_interleave(num_groups, dim=head_dim_axis)


def _per_sample_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = expand_kv(k, groups, 1), expand_kv(v, groups, 1)
    # .tolist() syncs with the device; this path runs on CPU (or as a test reference).
    bounds = cu_seqlens.tolist()
    out = torch.zeros_like(q)   # positions past cu_seqlens[-1] (if any) stay 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        seg = lambda t: t[start:end].transpose(0, 1)     # [H, L, D]
        o = F.scaled_dot_product_attention(seg(q), seg(k), seg(v), is_causal=True, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


@torch.library.custom_op("furlong::packed_attention_ref", mutates_args=())
def _per_sample_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                   max_seqlen: int, scale: float) -> torch.Tensor:
    return _per_sample_eager(q, k, v, cu_seqlens, scale)


@_per_sample_op.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q)


def _segment_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal softmax attention's gradients for one sample, heads first: grad, q, k, v [H, L, D]
    (k, v already expanded to q's heads). P = softmax(scale q k^T + causal mask), O = P v:
    dV = P^T dO, dS = P (dO v^T - rowsum(dO O)), dQ = scale dS k, dK = scale dS^T q."""
    length = q.shape[1]
    scores = scale * q @ k.transpose(1, 2)
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    p = scores.masked_fill(future, float("-inf")).softmax(-1)
    out = p @ v
    ds = p * (grad @ v.transpose(1, 2) - (grad * out).sum(-1, keepdim=True))
    return scale * ds @ k, scale * ds.transpose(1, 2) @ q, p.transpose(1, 2) @ grad


@torch.library.custom_op("furlong::packed_attention_ref_backward", mutates_args=())
def _per_sample_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens: torch.Tensor, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # explicit formulas (no autograd inside an op), in fp32 at least, per sample as the forward
    acc = torch.promote_types(q.dtype, torch.float32)
    num_kv, groups = k.shape[1], q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        seg = lambda t, n=1: expand_kv(t[start:end].to(acc).transpose(0, 1), n, 0)   # noqa: E731  [H, L, D]
        gq, gk, gv = _segment_backward(seg(grad), seg(q), seg(k, groups), seg(v, groups), scale)
        dq[start:end] = gq.transpose(0, 1)
        # an expanded head's gradient goes back to its K/V head: heads h*groups .. h*groups+groups-1
        dk[start:end] = gk.unflatten(0, (num_kv, groups)).sum(1).transpose(0, 1)
        dv[start:end] = gv.unflatten(0, (num_kv, groups)).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_per_sample_backward_op.register_fake
def _(grad, q, k, v, cu_seqlens, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _per_sample_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, _, scale = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens)
    ctx.scale = scale


def _per_sample_grad(ctx, grad):
    q, k, v, cu_seqlens = ctx.saved_tensors
    return (*_per_sample_backward_op(grad, q, k, v, cu_seqlens, ctx.scale), None, None, None)


_per_sample_op.register_autograd(_per_sample_grad, setup_context=_per_sample_setup)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
           max_seqlen: int, scale: float) -> torch.Tensor:
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    # positional: dropout_p 0, is_causal, no debug mask; output 0 of (out, lse, rng state, ...)
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True, False,
                                                   scale=scale)[0]


_PACKED_IMPLS: dict[str, PackedAttnFn] = {"flash": _flash, "per_sample": _per_sample_op}


@functools.lru_cache(maxsize=None)
def _has_flash() -> bool:
    return hasattr(torch.ops.aten, "_flash_attention_forward")


def select_packed_impl(q: torch.Tensor) -> str:
    """The fastest exact implementation available for tensors like q."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _has_flash():
        return "flash"
    return "per_sample"


def packed_attention_fn(q: torch.Tensor) -> PackedAttnFn:
    """The function `packed_attention` would use for tensors like q, for callers that pick it once
    (outside a compiled region: the choice itself does not trace) and call it per layer."""
    return _PACKED_IMPLS[select_packed_impl(q)]


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
    if name == "flash" and not _has_flash():
        raise ValueError("packed attention impl 'flash' needs torch.ops.aten._flash_attention_forward")
    return _PACKED_IMPLS[name](q, k, v, cu_seqlens, max_seqlen, q.shape[-1] ** -0.5)
