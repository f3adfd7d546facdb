"""Triton kernels for the chunked log-probs (CUDA only; imported lazily by logprobs.py).

Same arithmetic as `_chunk_stats` / `_chunk_grad` in logprobs.py, one pass over a chunk's
[C, V] logits each, where the eager (or torch.compile'd) versions take several:

  stats: per row, an online logsumexp over V in blocks (running max m, sum s of exp(z - m) and
         sum t of exp(z - m) * z, rescaled when m grows): lse = m + log s, entropy = lse - t / s,
         logp = z[y] - lse. Reads the bf16 logits once; writes three fp32 numbers per row.
  grad:  dL/dz_v = g_logp * (onehot(y)_v - p_v) - g_ent * p_v * (z_v - (lse - ent)), divided by the
         temperature, written over the logits in place (the chunk's logits are a temporary made
         for this backward): one read and one write of the chunk.
On the seed step these took ~150 ms of a 1.5 s train step as compiled PyTorch (BENCHMARKS.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def _stats_kernel(z_ptr, stride, targets_ptr, lse_ptr, logp_ptr, ent_ptr, num_cols, inv_temp,
                  WITH_ENT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    t = tl.full([], 0.0, tl.float32)
    for start in range(0, num_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < num_cols
        z = tl.load(base + offs, mask=mask, other=-float("inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        p = tl.exp(z - m_new)                       # 0 on masked lanes (z = -inf)
        s = s * scale + tl.sum(p, axis=0)
        if WITH_ENT:
            t = t * scale + tl.sum(tl.where(mask, p * z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    y = tl.load(targets_ptr + row)
    zy = tl.load(base + y).to(tl.float32) * inv_temp
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, zy - lse)
    if WITH_ENT:
        tl.store(ent_ptr + row, lse - t / s)


@triton.jit
def _grad_kernel(z_ptr, stride, targets_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, num_cols, inv_temp,
                 HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride
    lse = tl.load(lse_ptr + row)
    y = tl.load(targets_ptr + row)
    gl = tl.full([], 0.0, tl.float32)
    ge = tl.full([], 0.0, tl.float32)
    mean_z = tl.full([], 0.0, tl.float32)                         # sum_v p_v z_v = lse - entropy
    if HAS_GLOGP:
        gl = tl.load(glogp_ptr + row)
    if HAS_GENT:
        ge = tl.load(gent_ptr + row)
        mean_z = lse - tl.load(ent_ptr + row)
    for start in range(0, num_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < num_cols
        z = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32) * inv_temp
        p = tl.exp(z - lse)
        g = -p * gl
        if HAS_GENT:
            g = g - ge * p * (z - mean_z)
        g = tl.where(offs == y, g + gl, g)
        tl.store(base + offs, (g * inv_temp).to(z_ptr.dtype.element_ty), mask=mask)


def chunk_stats(zb: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """(lse, logp, entropy or None) [C] fp32 of raw logits zb [C, V] (contiguous rows)."""
    zb = zb if zb.stride(1) == 1 else zb.contiguous()
    rows = zb.shape[0]
    lse = torch.empty(rows, dtype=torch.float32, device=zb.device)
    logp = torch.empty_like(lse)
    ent = torch.empty_like(lse) if with_entropy else lse   # placeholder pointer when unused
    if rows:
        _stats_kernel[(rows,)](zb, zb.stride(0), targets, lse, logp, ent, zb.shape[1], 1.0 / temperature,
                               WITH_ENT=with_entropy, BLOCK=BLOCK_V, num_warps=8)
    return lse, logp, ent if with_entropy else None


def chunk_grad(zb: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
               grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None, temperature: float,
               out_dtype: torch.dtype) -> torch.Tensor:
    """dL/d(h W^T) [C, V] in out_dtype, written over zb (which must be out_dtype and contiguous)."""
    if zb.dtype != out_dtype or zb.stride(1) != 1:
        zb = zb.to(out_dtype).contiguous()
    rows = zb.shape[0]
    has_gl, has_ge = grad_logp is not None, grad_ent is not None
    if rows:
        dummy = lse
        _grad_kernel[(rows,)](zb, zb.stride(0), targets, lse, ent if has_ge else dummy,
                              grad_logp.float().contiguous() if has_gl else dummy,
                              grad_ent.float().contiguous() if has_ge else dummy,
                              zb.shape[1], 1.0 / temperature, HAS_GLOGP=has_gl, HAS_GENT=has_ge,
                              BLOCK=BLOCK_V, num_warps=8)
    return zb
