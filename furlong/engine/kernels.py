"""Triton attention kernels of the engine (CUDA only; imported lazily; the sampler: sample_kernels.py).

paged_decode_attention  one query token per row over its paged KV (flash-decoding).
    Grid (row, kv head, split). A program loads the GROUP query heads that share
    one KV head (GQA without copying K/V; padded to 16 rows for tl.dot), walks
    its split's share of the row's KV tiles (BLOCK_N tokens inside one page),
    and keeps an online softmax. With one split it writes the output directly;
    with several, each split writes its partial output and log-sum-exp and a
    second kernel combines them. Splits exist for small batches, where rows x
    KV heads alone would leave most of the GPU's multiprocessors idle.
    Cascade (cascade.py): extra programs, one per group of rows forked from one
    prompt, read the prompt's KV once for all members' query heads; each row's
    own programs start after the prompt, and the combine merges both.
    fp8 cache (kv_fp8.py): a tile's K and V are loaded as e4m3 (half the bytes),
    widened to fp16 for the dots (exact: e4m3 is a subset of fp16; one convert
    instruction, where bf16 takes a detour through fp32: measured 8.1 ms against
    6.4 ms for bf16 K/V at B=256 with that detour), and their per-token scales
    applied outside them: a score column is multiplied by its key's scale, a
    probability column by its value's scale relative to the tile's largest
    before P.V, the largest after. An fp8 cache's V is stored dim-major (kv_cache.KVLayout.dim_major
    says why): its tile loads 16 bytes wide, unmasked, and reaches the dot through ldmatrix (the loop
    body per warp 1,363 -> 906 instructions at 2 warps); on an H100 that made the layer 1.11x faster
    at B=256 x 4096 (2.60 -> 2.88 TB/s; 1 warp 0.741 ms, ~3.0 TB/s). Both dtypes' kernels read within
    ~10% of that card's 3.35 TB/s peak there.
Both kernels are fixed-shape and sync-free, so they are captured in the decode CUDA graphs; the KV
store kernel is store_kernels.py.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from furlong.engine.cascade import PrefixGroups
from furlong.engine.kv_cache import value_layout


@triton.jit
def split_tiles(lo, hi, part, num_parts, BLOCK_N: tl.constexpr):
    """KV tiles [t0, t1) that split `part` of `num_parts` reads of the tokens [lo, hi): equal runs of the
    BLOCK_N-token tiles covering them (both kernels; the combine kernel merges the splits' outputs)."""
    t_lo = lo // BLOCK_N
    per_split = tl.cdiv(tl.cdiv(hi, BLOCK_N) - t_lo, num_parts)
    t0 = t_lo + part * per_split
    return t0, tl.minimum(t0 + per_split, tl.cdiv(hi, BLOCK_N))


@triton.jit
def _decode_attn_kernel(Q, K, V, KS, VS, BT, CL, PL, GR, GP, O, LSE, OUT,
                        s_qb, s_qh, s_kp, s_kh, s_ks, s_sp, s_sh, s_bt, s_gr, s_ob, s_oh, s_os, s_lb, s_lh, s_outb,
                        s_outh, scale, num_splits, group_splits, first_split,
                        GROUP: tl.constexpr, QP: tl.constexpr, MEMBERS: tl.constexpr, D: tl.constexpr,
                        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, CASCADE: tl.constexpr,
                        FP8: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr, EARLY_V: tl.constexpr,
                        V_DIM_MAJOR: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2) + first_split   # first_split S: a launch of the cascade's group programs only
    i = tl.arange(0, QP)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    if CASCADE:
        # sp < S: split sp of row pid's own tokens [PL[pid], CL[pid]) -> slot sp. sp == S: split
        # pid % GS of group pid // GS's shared prefix [0, GP[g]), for all its members' query heads at
        # once (QP = MEMBERS * GROUP slots) -> slot S + pid % GS of each member row
        is_group = sp >= num_splits
        g = pid // group_splits
        # a where, not `is_group & ...`: the Triton interpreter makes a scalar & block mask int32
        member = tl.load(GR + g * s_gr + i // GROUP, mask=tl.where(is_group, i // GROUP < MEMBERS, False), other=-1)
        rows = tl.where(is_group, member, pid)
        heads = kvh * GROUP + tl.where(is_group, i % GROUP, i)
        hmask = tl.where(is_group, member >= 0, i < GROUP)
        lo = tl.where(is_group, 0, tl.load(PL + pid))
        hi = tl.where(is_group, tl.load(GP + g), tl.load(CL + pid))
        table_row = tl.where(is_group, tl.maximum(tl.load(GR + g * s_gr), 0), pid)
        part = tl.where(is_group, pid % group_splits, sp)
        num_parts = tl.where(is_group, group_splits, num_splits)
        slot = tl.where(is_group, num_splits + part, sp)
    else:
        rows = pid + 0 * i
        heads = kvh * GROUP + i
        hmask = i < GROUP
        lo = 0
        hi = tl.load(CL + pid)
        table_row = pid
        slot = sp
        part = sp
        num_parts = num_splits
    rows = tl.maximum(rows, 0)
    t0, t1 = split_tiles(lo, hi, part, num_parts, BLOCK_N)
    q = tl.load(Q + rows[:, None] * s_qb + heads[:, None] * s_qh + d[None, :], mask=hmask[:, None], other=0.0)
    m = tl.full([QP], float("-inf"), tl.float32)
    l = tl.zeros([QP], tl.float32)
    acc = tl.zeros([QP, D], tl.float32)
    for t in range(t0, t1):
        start = t * BLOCK_N
        page = tl.load(BT + table_row * s_bt + start // PAGE).to(tl.int64)
        off = page * s_kp + kvh * s_kh + (start % PAGE + n)[:, None] * s_ks + d[None, :]
        valid = ((start + n) < hi) & ((start + n) >= lo)
        k = tl.load(K + off, mask=valid[:, None], other=0.0)
        if V_DIM_MAJOR:
            # tokens contiguous: unmasked, so the loads stay 16 bytes wide (a mask along the contiguous
            # dim splits them into bytes); slots outside [lo, hi) hold finite values (the launcher's
            # docstring) that p weighs by exactly 0
            v_ptr = V + (page * s_kp + kvh * s_kh + (tl.multiple_of(start % PAGE, BLOCK_N) + n)[:, None]
                         + d[None, :] * PAGE)
        if EARLY_V:   # V's load issued beside K's (the launcher says when)
            v = tl.load(v_ptr) if V_DIM_MAJOR else tl.load(V + off, mask=valid[:, None], other=0.0)
        if FP8:
            # e4m3 -> fp16 is one conversion instruction per pair on sm90 (to bf16 it goes through
            # fp32), so an fp8 tile's dots run in fp16: q, p and the scaled values are far inside its range
            s_off = page * s_sp + kvh * s_sh + start % PAGE + n            # [BLOCK_N] this tile's scales
            s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision=PRECISION)
            s = s * (tl.load(KS + s_off, mask=valid, other=0.0) * scale)[None, :]
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [QP, BLOCK_N] fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))   # finite: every tile in [lo, hi) holds a token of the range
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        if not EARLY_V:
            v = tl.load(v_ptr) if V_DIM_MAJOR else tl.load(V + off, mask=valid[:, None], other=0.0)
        if FP8:
            # value scales relative to the tile's largest, so p * scale stays in fp16's normal range
            # (a small-magnitude head's scales alone could flush to zero); the largest multiplies after
            vsc = tl.load(VS + s_off, mask=valid, other=0.0)
            vmax = tl.maximum(tl.max(vsc, 0), 1e-30)
            pv = p * (vsc / vmax)[None, :]
            acc = acc * alpha[:, None] + tl.dot(pv.to(DOT), v.to(DOT), input_precision=PRECISION) * vmax
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    has = l > 0
    safe = tl.where(has, l, 1.0)
    out = acc / safe[:, None]
    if DIRECT:
        tl.store(OUT + rows[:, None] * s_outb + heads[:, None] * s_outh + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=hmask[:, None])
    else:
        tl.store(O + rows[:, None] * s_ob + heads[:, None] * s_oh + slot * s_os + d[None, :], out,
                 mask=hmask[:, None])
        tl.store(LSE + rows * s_lb + heads * s_lh + slot, tl.where(has, m + tl.log(safe), float("-inf")), mask=hmask)


@triton.jit
def _combine_kernel(O, LSE, OUT, PL, s_ob, s_oh, s_os, s_lb, s_lh, s_outb, s_outh, num_splits, num_group_splits,
                    D: tl.constexpr, S_PAD: tl.constexpr, CASCADE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    smask = s < num_splits
    if CASCADE:
        # the group's prefix parts follow the row's own, written only for rows in a group
        smask = s < tl.where(tl.load(PL + b) > 0, num_splits + num_group_splits, num_splits)
    lse = tl.load(LSE + b * s_lb + h * s_lh + s, mask=smask, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(smask, tl.exp(lse - mx), 0.0)
    total = tl.sum(w, 0)
    total = tl.where(total > 0, total, 1.0)
    d = tl.arange(0, D)
    o = tl.load(O + b * s_ob + h * s_oh + s[:, None] * s_os + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / total
    tl.store(OUT + b * s_outb + h * s_outh + d, out.to(OUT.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, num_splits: int, block_n: int = 64,
                           prefix: PrefixGroups | None = None, group_splits: int = 1,
                           key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
                           num_warps: int | None = None, num_stages: int = 2,
                           early_v: bool | None = None, transposed: bool = False) -> torch.Tensor:
    """q [B, Hq, D]; keys/values [num_pages, Hkv, page, D]; block_tables [B, max_pages] int32;
    context_lens [B] int32 -> [B, Hq, D] in q's dtype (zeros where context_lens is 0).
    fp8 cache: keys/values float8_e4m3fn, key/value_scales [num_pages, Hkv, page] float32 (same strides).
    values may be token-major like keys or dim-major (strides (1, page) in its last two dims,
    kv_cache.KVLayout.dim_major); dim-major values are read a whole tile at a time, so every slot of a
    row's pages must hold a finite value, past its context too (the engine zeroes such a cache).
    prefix (cascade): rows that share their first tokens' KV read it once per group (see PrefixGroups),
    each group's prefix split `group_splits` ways; the first B // group_splits groups are read. A
    grouped row's prefix must be shorter than its context (the engine's always is: it holds the prompt).
    transposed: an fp8 cache's row programs run kernels_transposed.py's kernel (the KV tokens as the
    dots' rows); with cascade groups the group programs are the padded kernel's, a second launch into the
    same partials. bf16 and token-major V ignore it."""
    num_rows, num_heads, dim = q.shape
    _, num_kv, page, _ = keys.shape
    group = num_heads // num_kv
    qp = max(16, triton.next_power_of_2(group))
    block_n = min(block_n, page)
    if page % block_n or dim & (dim - 1):
        raise ValueError(f"paged_decode_attention: page {page} must be a multiple of {block_n}, head_dim a power of 2")
    fp8 = key_scales is not None
    v_dim_major = value_layout(keys, values)
    # measured on an H200 (bench/decode_kernel_sweep.py): an fp8 tile's program is latency-bound, and
    # 2 warps run it 1.3-1.5x faster than 4 (B=256 at 4096 tokens: 0.85 against 1.26 ms per layer;
    # bf16 0.94 ms, where 2 and 4 warps tie); bf16 keeps 4. With V dim-major 1 warp is faster still at
    # each engine setting swept (an H100: 0.741 against 0.769 ms at B=256 x 4096, 0.020 against 0.023 ms
    # at B=32 x 640); the sweep had no cascade groups, whose programs keep the 2 warps they were
    # measured and tested with
    # (the transposed kernel's programs, cascade launches' row programs included: 1 warp)
    row_warps = num_warps or 1
    num_warps = num_warps or (4 if not fp8 else 1 if v_dim_major and prefix is None else 2)
    # V's load issued beside K's: fp8 0.848 against 0.902 ms at B=256 x 4096, 0.144 against 0.154 at x 640
    # (an H100); bf16 ties either way and keeps V's load after the softmax
    early_v = fp8 if early_v is None else early_v
    if fp8 and (key_scales.stride() != value_scales.stride() or key_scales.stride(-1) != 1):
        raise ValueError("paged_decode_attention: key/value scales must be laid out alike, tokens contiguous")
    ks, vs = (key_scales, value_scales) if fp8 else (context_lens, context_lens)   # unused without fp8
    out = torch.empty_like(q)
    cascade = prefix is not None
    direct = num_splits == 1 and not cascade
    num_slots = num_splits + group_splits if cascade else num_splits
    if direct:
        part, lse = out, out   # unused
    else:
        part = torch.empty(num_rows, num_heads, num_slots, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_rows, num_heads, num_slots, dtype=torch.float32, device=q.device)
    if cascade:
        pl, gr, gp = prefix.prefix_lens, prefix.group_rows, prefix.group_prefix
        members = gr.shape[1]
        if members * group > qp or gr.shape[0] != num_rows or gp.shape[0] != num_rows:
            raise ValueError(f"paged_decode_attention: group tables {tuple(gr.shape)} must be [{num_rows}, "
                             f"<= {qp // group}]")
    else:
        pl = gr = gp = context_lens     # unused
        members = 1
    transposed = transposed and fp8 and v_dim_major
    if transposed:
        from furlong.engine.kernels_transposed import launch_transposed
        launch_transposed(q, keys, values, key_scales, value_scales, block_tables, context_lens, num_splits,
                          block_n, part, lse, out, direct, row_warps, num_stages,
                          pl if cascade else None)
    if cascade or not transposed:
        first = num_splits if transposed else 0          # transposed: the row programs ran above
        _decode_attn_kernel[(num_rows, num_kv, num_splits + 1 - first if cascade else num_splits)](
            q, keys, values, ks, vs, block_tables, context_lens, pl, gr, gp, part, lse, out,
            q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
            ks.stride(0) if fp8 else 0, ks.stride(1) if fp8 else 0, block_tables.stride(0),
            gr.stride(0), part.stride(0), part.stride(1), part.stride(2) if not direct else 0, lse.stride(0),
            lse.stride(1), out.stride(0), out.stride(1), 1.0 / math.sqrt(dim), num_splits,
            group_splits, first, GROUP=group, QP=qp, MEMBERS=members, D=dim, PAGE=page, BLOCK_N=block_n,
            DIRECT=direct, CASCADE=cascade, FP8=fp8, V_DIM_MAJOR=v_dim_major,
            DOT=tl.float32 if q.dtype == torch.float32 else tl.float16,   # fp8 tiles' dot dtype (docstring)
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", EARLY_V=early_v, num_warps=num_warps,
            num_stages=num_stages)
    if not direct:
        _combine_kernel[(num_rows, num_heads)](
            part, lse, out, pl, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), num_splits, group_splits, D=dim,
            S_PAD=triton.next_power_of_2(num_slots),
            CASCADE=cascade)
    return out
