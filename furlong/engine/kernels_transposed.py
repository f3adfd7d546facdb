"""The fp8 decode attention kernel, transposed: the KV tile's tokens as the dots' rows (CUDA only).

kernels.py's kernel computes S = Q.K^T with a program's GQA group of query heads as the dot's rows,
padded to 16 (tensor-core tiles are 16 rows tall): for Qwen3-0.6B's group of 2, 14 of the 16 rows are
padding, and every elementwise step of the online softmax (key scales, masking, max, exp, value scales)
and the P.V dot pay for them. Here the same products run transposed,

    S^T = K . Q^T        [BLOCK_N tokens, GP heads]   (K: A operand, token-major as stored)
    O^T += V^T . P^T     [D, GP]                      (V^T: A operand, the fp8 cache's dim-major V as stored)

so the group is the dots' column dimension, which an sm_80/sm_90 mma tile holds 8 wide (Triton 3.6
pads a narrower one, min_dot_size): the padding is 8/GROUP, not 16/GROUP. Compiled for sm_90 offline
(bench/kernel_sass.py --transposed; 1 warp, 2 stages, the 0.6B shape): the KV-tile loop is 875 SASS
instructions per warp against the padded kernel's 1,615: half its HMMAs (64 against 128), a third of
its FMULs (95 against 296), 205 registers against 255 (9 one-warp programs per multiprocessor instead
of 8); the 256 fp8 -> fp16 converts of a tile's K and V are the same in both. At 2 warps: 511 per
warp, 162 registers. Written as the padded kernel's loop (masked K loads, base-e softmax, a separate
P.V accumulate), it compiled to 1,063 at 8 columns and 1,574 at 16: most of the saving is the padding,
~190 instructions the three changes (below). On an H100 one layer's attention is 1.01-1.06x faster at
6,144-token contexts (B=256 to 12), 0.98x at B=256 x 1,024, and the long rollout 60.9 -> 57.7 s
(BENCHMARKS.md). With its row programs in cascade launches too ("transposed-all", the engine's default
for fp8: kv_cache.FP8_KERNELS) the long rollout with prompts of 260-596 tokens, which form cascade groups,
took 64.1 s against 72.2 s with those launches left to the padded kernel (H100).

Same inputs, scales, splits and outputs as the padded kernel's non-cascade programs (kernels.py's
docstring), so its partial outputs go to the same combine kernel. fp8 only, V dim-major only. In a
cascade launch (CASCADE) it runs the row programs only, each row's own tokens [PL[row], CL[row]) into
slots [0, num_splits); the group programs (MEMBERS x GROUP real rows: no padding to save) stay the
padded kernel's, launched beside it into the slots after (kernels.paged_decode_attention).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from furlong.engine.kernels import split_tiles


@triton.jit
def _decode_attn_transposed_kernel(Q, K, V, KS, VS, BT, CL, PL, O, LSE, OUT,
                                   s_qb, s_qh, s_kp, s_kh, s_ks, s_sp, s_sh, s_bt, s_ob, s_oh, s_os, s_lb, s_lh,
                                   s_outb, s_outh, scale, num_splits,
                                   GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                                   BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, DOT: tl.constexpr,
                                   PRECISION: tl.constexpr, CASCADE: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + g
    hmask = g < GROUP
    hi = tl.load(CL + row)
    lo = tl.load(PL + row) if CASCADE else 0     # a grouped row's prompt is its group program's
    t0, t1 = split_tiles(lo, hi, sp, num_splits, BLOCK_N)
    # Q^T [D, GP]; fp16 for the dots, as the padded kernel (e4m3 widens to fp16 in one instruction). The
    # softmax runs in base 2 with 1/sqrt(D) and log2(e) folded into Q (one rounding of q to fp16: 2^-11
    # relative, against e4m3's 2^-4 on K): two multiplies a score fewer, m and the log-sum-exp in log2 units
    qt = tl.load(Q + row * s_qb + heads[None, :] * s_qh + d[:, None], mask=hmask[None, :], other=0.0)
    qt = (qt.to(tl.float32) * (scale * 1.4426950408889634)).to(DOT)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([D, GP], tl.float32)
    unit = 1.0
    for t in range(t0, t1):
        start = t * BLOCK_N
        page = tl.load(BT + row * s_bt + start // PAGE).to(tl.int64)
        base = page * s_kp + kvh * s_kh
        slot = tl.multiple_of(start % PAGE, BLOCK_N) + n
        valid = (start + n) < hi
        if CASCADE:
            valid = valid & ((start + n) >= lo)
        # K [N, D] and its scales unmasked (no predicates: 89 instructions a tile fewer than masked loads):
        # a slot outside [lo, hi) is inside the row's page, and whatever it holds, NaN bytes included,
        # stays in its own row of S^T, which the `where` below replaces
        k = tl.load(K + base + slot[:, None] * s_ks + d[None, :])
        # V^T [D, N], tokens contiguous: unmasked (16-byte loads) too, but p weighs a slot past the context
        # by 0, and 0 * NaN is NaN: the engine zeroes the V cache when it maps it
        v = tl.load(V + base + slot[None, :] + d[:, None] * PAGE)
        s_off = page * s_sp + kvh * s_sh + slot                                                    # [N] scales
        st = tl.dot(k.to(DOT), qt, input_precision=PRECISION)                                     # [N, GP] fp32
        st = tl.where(valid[:, None], st * tl.load(KS + s_off)[:, None], float("-inf"))
        m_new = tl.maximum(m, tl.max(st, 0))   # finite: every tile in range holds a token
        p = tl.exp2(st - m_new[None, :])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 0)
        # value scales relative to the tile's largest, so p * scale stays in fp16's normal range. acc is
        # kept in units of the latest tile's largest scale, so the dot accumulates into it (no separate
        # multiply and add: 16 instructions a tile fewer, 206 registers against 228). The floor
        # bounds how far a tile of tiny values scales acc up: |acc| <= tokens x max|v| / floor, ~1e27 at
        # 1e5 tokens of |v| <= 1e10, far inside fp32 (a tile of values all under 448 x 2^-40 is read
        # at fp16's subnormal precision)
        vsc = tl.load(VS + s_off, mask=valid, other=0.0)
        vmax = tl.maximum(tl.max(vsc, 0), 9.094947017729282e-13)      # 2^-40
        pv = p * (vsc / vmax)[:, None]
        acc = tl.dot(v.to(DOT), pv.to(DOT), acc=acc * (alpha * (unit / vmax))[None, :], input_precision=PRECISION)
        unit = vmax
        m = m_new
    has = l > 0
    safe = tl.where(has, l, 1.0)
    out = acc * (unit / safe)[None, :]                                                                   # [D, GP]
    if DIRECT:
        tl.store(OUT + row * s_outb + heads[None, :] * s_outh + d[:, None], out.to(OUT.dtype.element_ty),
                 mask=hmask[None, :])
    else:
        tl.store(O + row * s_ob + heads[None, :] * s_oh + sp * s_os + d[:, None], out, mask=hmask[None, :])
        tl.store(LSE + row * s_lb + heads * s_lh + sp, tl.where(has, m * 0.6931471805599453 + tl.log(safe),
                                                                 float("-inf")), mask=hmask)   # natural log


def launch_transposed(q, keys, values, key_scales, value_scales, block_tables, context_lens, num_splits: int,
                      block_n: int, part, lse, out, direct: bool, num_warps: int, num_stages: int,
                      prefix_lens: torch.Tensor | None = None) -> None:
    """The kernel over grid (rows, KV heads, splits), arguments as kernels.paged_decode_attention prepares
    them (part/lse: the split partials, unused when `direct`); prefix_lens [B] int32: a cascade launch's
    row programs, each row from its prefix on."""
    num_rows, num_heads, dim = q.shape
    _, num_kv, page, _ = keys.shape
    group = num_heads // num_kv
    _decode_attn_transposed_kernel[(num_rows, num_kv, num_splits)](
        q, keys, values, key_scales, value_scales, block_tables, context_lens,
        context_lens if prefix_lens is None else prefix_lens, part, lse, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), key_scales.stride(0),
        key_scales.stride(1), block_tables.stride(0), part.stride(0), part.stride(1),
        part.stride(2) if not direct else 0, lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        1.0 / math.sqrt(dim), num_splits, GROUP=group, GP=max(8, triton.next_power_of_2(group)), D=dim, PAGE=page,
        BLOCK_N=block_n, DIRECT=direct, DOT=tl.float32 if q.dtype == torch.float32 else tl.float16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", CASCADE=prefix_lens is not None,
        num_warps=num_warps, num_stages=num_stages)
