"""The engine's KV store kernel (CUDA only; imported lazily): new tokens' k and v into the paged cache.

store_kv  each new token's k and v into its (page, offset) slot, one program per
    (token, kv head): one launch per layer instead of two generic index_put kernels;
    for an fp8 cache it quantises the row with its absmax scale (kv_fp8.py) and
    writes V in the cache's layout (token- or dim-major, kv_cache.value_layout).
Fixed-shape and sync-free, so it is captured in the decode CUDA graphs.
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
    s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), 448.0), 1e-30)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0)
    # round to nearest even on the e4m3 grid here, so the cast to fp8 below is exact (the Triton
    # interpreter's own fp32 -> e4m3 rounding drops the carry into the next binade): the grid step
    # in y's binade is 2^(E-3), E >= -6 (subnormals share 2^-6's step), a power of two built from
    # its bits; 1.5 * 2^23 added and taken away rounds |z| < 16 to an integer, ties to even; the
    # sign is put back after (-0 stays -0)
    bits = y.to(tl.int32, bitcast=True)
    ey = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    z = tl.abs(y) * ((130 - ey) << 23).to(tl.float32, bitcast=True)            # * 2^(3 - ey)
    z = ((z + 12582912.0) - 12582912.0) * ((124 + ey) << 23).to(tl.float32, bitcast=True)   # * 2^(ey - 3)
    return tl.where(bits < 0, -z, z), s


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
