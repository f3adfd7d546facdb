"""The engine's KV store kernels (CUDA only; imported lazily): new tokens' k and v into the paged cache.

store_kv  each new token's k and v into its (page, offset) slot, one program per
    (token, kv head): one launch per layer instead of two generic index_put kernels;
    for an fp8 cache it quantises the row with its absmax scale (kv_fp8.py) and
    writes V in the cache's layout (token- or dim-major, kv_cache.value_layout).
decode_prologue  the same store with the step before it folded in: from the fused
    q|k|v projection it applies the q/k RMSNorm and RoPE (forward.pre_attention's
    arithmetic), writes q for the attention kernel and stores k and v. A decode step
    is mostly small kernels of ~3 us each; this one takes the place of three per layer
    (the compiled q and k norm/RoPE kernels and store_kv): measured on an H100 at
    B=256 x 640 with fp8 K/V, 418 -> 362 kernels and 3.501 -> 3.414 ms per step
    (bench/profile_decode.py --fuse-prologue both).
Fixed-shape and sync-free, so they are captured in the decode CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from furlong.engine.kv_cache import value_layout


@triton.jit
def _quantize_row(x):
    """x [D] -> (x / s rounded to the e4m3 grid, in fp32; s), as kv_fp8.quantize: s = max(absmax / 448,
    1e-30), IEEE divisions (Triton's `/` on fp32 is approximate)."""
    x = x.to(tl.float32)
    s = _e4m3_scale(tl.max(tl.abs(x), 0))
    return _e4m3_grid(x, s), s


@triton.jit
def _e4m3_scale(absmax):
    return tl.maximum(tl.math.div_rn(absmax, 448.0), 1e-30)


@triton.jit
def _e4m3_grid(x, s):
    """x (fp32) / s clamped to +-448 and rounded to nearest even on the e4m3 grid, in fp32."""
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0)
    # round to nearest even on the e4m3 grid here, so the cast to fp8 where stored is exact (the Triton
    # interpreter's own fp32 -> e4m3 rounding drops the carry into the next binade): the grid step
    # in y's binade is 2^(E-3), E >= -6 (subnormals share 2^-6's step), a power of two built from
    # its bits; 1.5 * 2^23 added and taken away rounds |z| < 16 to an integer, ties to even; the
    # sign is put back after (-0 stays -0)
    bits = y.to(tl.int32, bitcast=True)
    ey = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    z = tl.abs(y) * ((130 - ey) << 23).to(tl.float32, bitcast=True)            # * 2^(3 - ey)
    z = ((z + 12582912.0) - 12582912.0) * ((124 + ey) << 23).to(tl.float32, bitcast=True)   # * 2^(ey - 3)
    return tl.where(bits < 0, -z, z)


@triton.jit
def _store_kv_kernel(K, V, KC, VC, KS, VS, PAGE, OFF, s_kn, s_kh, s_vn, s_vh, s_cp, s_ch, s_cs, s_sp, s_sh,
                     s_vcs, s_vcd, D: tl.constexpr, FP8: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    page = tl.load(PAGE + n)
    off = tl.load(OFF + n)
    dst = page * s_cp + h * s_ch + off * s_cs + d
    k = tl.load(K + n * s_kn + h * s_kh + d)
    v = tl.load(V + n * s_vn + h * s_vh + d)
    if FP8:
        k, ks = _quantize_row(k)
        v, vs = _quantize_row(v)
        tl.store(KS + page * s_sp + h * s_sh + off, ks)
        tl.store(VS + page * s_sp + h * s_sh + off, vs)
    tl.store(KC + dst, k.to(KC.dtype.element_ty))
    tl.store(VC + page * s_cp + h * s_ch + off * s_vcs + d * s_vcd, v.to(VC.dtype.element_ty))


def store_kv(keys: torch.Tensor, values: torch.Tensor, page: torch.Tensor, offset: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, key_scales: torch.Tensor | None = None,
             value_scales: torch.Tensor | None = None) -> None:
    """k, v [N, Hkv, D] into keys/values [P, Hkv, page, D] (values token- or dim-major, value_layout) at
    (page[i], offset[i]);
    fp8 cache: quantised, each row's scale into key/value_scales [P, Hkv, page] (same strides)."""
    num, num_kv, dim = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("store_kv: head dim must be contiguous in k and v")
    value_layout(keys, values)          # raises unless values are paged like keys (either layout)
    fp8 = key_scales is not None
    if fp8 and key_scales.stride() != value_scales.stride():
        raise ValueError("store_kv: key/value scales must be laid out alike")
    ks, vs = (key_scales, value_scales) if fp8 else (page, page)       # unused without fp8
    _store_kv_kernel[(num, num_kv)](k, v, keys, values, ks, vs, page, offset, k.stride(0), k.stride(1), v.stride(0),
                                   v.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
                                   ks.stride(0) if fp8 else 0, ks.stride(1) if fp8 else 0, values.stride(2),
                                   values.stride(3), D=dim, FP8=fp8, num_warps=1)


@triton.jit
def _norm_rope(x1, x2, W, c1, s1, c2, s2, eps, half, D: tl.constexpr, NORM: tl.constexpr, DT: tl.constexpr):
    """One head's row as its two halves x1, x2 [D/2] (fp32 from the model dtype DT) -> its RMSNorm
    (weight W [D]; NORM) and RoPE (rotate-half, cos/sin halves c1, s1, c2, s2) in fp32, rounded to DT
    where forward.rms_norm and forward.rope round: the normalised row before the weight's product, that
    product, and the rotated row."""
    if NORM:
        r = tl.math.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
        x1 = (tl.load(W + half).to(tl.float32) * (x1 * r).to(DT).to(tl.float32)).to(DT).to(tl.float32)
        x2 = (tl.load(W + D // 2 + half).to(tl.float32) * (x2 * r).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    return (x1 * c1 - x2 * s1).to(DT).to(tl.float32), (x2 * c2 + x1 * s2).to(DT).to(tl.float32)


@triton.jit
def _decode_prologue_kernel(QKV, QN, KN, COS, SIN, QOUT, KC, VC, KS, VS, PAGE, OFF, s_x, s_c, s_q, s_qh,
                            s_cp, s_ch, s_cs, s_sp, s_sh, s_vcs, s_vcd, eps, HQ: tl.constexpr,
                            HKV: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)                  # the KV head; its GQA group's query heads come with it
    half = tl.arange(0, D // 2)
    DT: tl.constexpr = QKV.dtype.element_ty
    c1 = tl.load(COS + n * s_c + half)
    c2 = tl.load(COS + n * s_c + D // 2 + half)
    s1 = tl.load(SIN + n * s_c + half)
    s2 = tl.load(SIN + n * s_c + D // 2 + half)
    row = QKV + n * s_x
    for g in tl.static_range(HQ // HKV):
        head = h * (HQ // HKV) + g
        x1 = tl.load(row + head * D + half).to(tl.float32)
        x2 = tl.load(row + head * D + D // 2 + half).to(tl.float32)
        y1, y2 = _norm_rope(x1, x2, QN, c1, s1, c2, s2, eps, half, D, NORM, DT)
        tl.store(QOUT + n * s_q + head * s_qh + half, y1.to(DT))
        tl.store(QOUT + n * s_q + head * s_qh + D // 2 + half, y2.to(DT))
    k1 = tl.load(row + (HQ + h) * D + half).to(tl.float32)
    k2 = tl.load(row + (HQ + h) * D + D // 2 + half).to(tl.float32)
    k1, k2 = _norm_rope(k1, k2, KN, c1, s1, c2, s2, eps, half, D, NORM, DT)
    v1 = tl.load(row + (HQ + HKV + h) * D + half).to(tl.float32)
    v2 = tl.load(row + (HQ + HKV + h) * D + D // 2 + half).to(tl.float32)
    page = tl.load(PAGE + n)
    off = tl.load(OFF + n)
    if FP8:
        ks = _e4m3_scale(tl.maximum(tl.max(tl.abs(k1), 0), tl.max(tl.abs(k2), 0)))
        vs = _e4m3_scale(tl.maximum(tl.max(tl.abs(v1), 0), tl.max(tl.abs(v2), 0)))
        k1, k2, v1, v2 = _e4m3_grid(k1, ks), _e4m3_grid(k2, ks), _e4m3_grid(v1, vs), _e4m3_grid(v2, vs)
        tl.store(KS + page * s_sp + h * s_sh + off, ks)
        tl.store(VS + page * s_sp + h * s_sh + off, vs)
    dst = KC + page * s_cp + h * s_ch + off * s_cs
    tl.store(dst + half, k1.to(KC.dtype.element_ty))
    tl.store(dst + D // 2 + half, k2.to(KC.dtype.element_ty))
    vdst = VC + page * s_cp + h * s_ch + off * s_vcs
    tl.store(vdst + half * s_vcd, v1.to(VC.dtype.element_ty))
    tl.store(vdst + (D // 2 + half) * s_vcd, v2.to(VC.dtype.element_ty))


def decode_prologue(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor,
                    sin: torch.Tensor, eps: float, keys: torch.Tensor, values: torch.Tensor, page: torch.Tensor,
                    offset: torch.Tensor, key_scales: torch.Tensor | None = None,
                    value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [N, (Hq + 2 Hkv) D] (the fused projection, forward.pre_attention's layout); q_norm/k_norm [D]
    (both or neither); cos/sin [N, D] fp32 -> q [N, Hq, D] normed and roped as pre_attention returns it,
    with k (normed, roped) and v stored at (page[i], offset[i]) as store_kv stores them."""
    num, width = qkv.shape
    _, num_kv, _, dim = keys.shape
    num_heads = width // dim - 2 * num_kv
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride() or cos.shape != (num, dim) or \
            dim & (dim - 1) or num_heads % num_kv or (q_norm is None) != (k_norm is None):
        raise ValueError("decode_prologue: qkv and cos/sin [N, head_dim] rows contiguous, head_dim a power of 2, "
                         "whole GQA groups, q and k norms both given or neither")
    value_layout(keys, values)
    fp8 = key_scales is not None
    q = torch.empty(num, num_heads, dim, dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    qn, kn = (q_norm, k_norm) if norm else (cos, cos)                   # unused without the norms
    ks, vs = (key_scales, value_scales) if fp8 else (page, page)       # unused without fp8
    _decode_prologue_kernel[(num, num_kv)](
        qkv, qn, kn, cos, sin, q, keys, values, ks, vs, page, offset, qkv.stride(0), cos.stride(0), q.stride(0),
        q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), ks.stride(0) if fp8 else 0,
        ks.stride(1) if fp8 else 0, values.stride(2), values.stride(3), eps, HQ=num_heads, HKV=num_kv, D=dim,
        NORM=norm, FP8=fp8, num_warps=1)
    return q
