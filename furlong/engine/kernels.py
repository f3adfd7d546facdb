"""Triton kernels of the engine (CUDA only; imported lazily).

paged_decode_attention  one query token per row over its paged KV (flash-decoding).
    Grid (row, kv head, split). A program loads the GROUP query heads that share
    one KV head (GQA without copying K/V; padded to 16 rows for tl.dot), walks
    its split's share of the row's KV tiles (BLOCK_N tokens inside one page),
    and keeps an online softmax. With one split it writes the output directly;
    with several, each split writes its partial output and log-sum-exp and a
    second kernel combines them. Splits exist for small batches, where rows x
    KV heads alone would leave most of the GPU's multiprocessors idle.
sample_tokens  one pass over a row's logits: the online log-sum-exp of the
    scaled logits (for the chosen token's log-prob) and the argmax of the
    exponential race with counter-based noise, exactly as sampling.py's
    reference (same hash, same threshold rule, first index on ties).
store_kv  each new token's k and v into its (page, offset) slot, one program per
    (token, kv head): one launch per layer instead of two generic index_put kernels.
All are fixed-shape and sync-free, so they are captured in the decode CUDA graphs.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_attn_kernel(Q, K, V, BT, CL, O, LSE, OUT,
                        s_qb, s_qh, s_kp, s_kh, s_ks, s_bt, s_ob, s_oh, s_os, s_lb, s_lh, s_outb, s_outh,
                        scale, num_splits,
                        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                        BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(CL + b)
    num_tiles = tl.cdiv(ctx, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    t0 = sp * per_split
    t1 = tl.minimum(t0 + per_split, num_tiles)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + g
    hmask = g < GROUP
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=hmask[:, None], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for t in range(t0, t1):
        start = t * BLOCK_N
        page = tl.load(BT + b * s_bt + start // PAGE).to(tl.int64)
        off = page * s_kp + kvh * s_kh + (start % PAGE + n)[:, None] * s_ks + d[None, :]
        valid = (start + n) < ctx
        k = tl.load(K + off, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_PAD, BLOCK_N] fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + off, mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    has = l > 0
    safe = tl.where(has, l, 1.0)
    out = acc / safe[:, None]
    if DIRECT:
        tl.store(OUT + b * s_outb + heads[:, None] * s_outh + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=hmask[:, None])
    else:
        tl.store(O + b * s_ob + heads[:, None] * s_oh + sp * s_os + d[None, :], out, mask=hmask[:, None])
        tl.store(LSE + b * s_lb + heads * s_lh + sp, tl.where(has, m + tl.log(safe), float("-inf")), mask=hmask)


@triton.jit
def _combine_kernel(O, LSE, OUT, s_ob, s_oh, s_os, s_lb, s_lh, s_outb, s_outh, num_splits,
                    D: tl.constexpr, S_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    smask = s < num_splits
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
                           context_lens: torch.Tensor, num_splits: int, block_n: int = 64) -> torch.Tensor:
    """q [B, Hq, D]; keys/values [num_pages, Hkv, page, D]; block_tables [B, max_pages] int32;
    context_lens [B] int32 -> [B, Hq, D] in q's dtype (zeros where context_lens is 0)."""
    num_rows, num_heads, dim = q.shape
    _, num_kv, page, _ = keys.shape
    group = num_heads // num_kv
    block_n = min(block_n, page)
    if page % block_n or dim & (dim - 1):
        raise ValueError(f"paged_decode_attention: page {page} must be a multiple of {block_n}, head_dim a power of 2")
    out = torch.empty_like(q)
    direct = num_splits == 1
    if direct:
        part, lse = out, out   # unused
    else:
        part = torch.empty(num_rows, num_heads, num_splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_attn_kernel[(num_rows, num_kv, num_splits)](
        q, keys, values, block_tables, context_lens, part, lse, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2) if not direct else 0, lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), 1.0 / math.sqrt(dim), num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=dim, PAGE=page, BLOCK_N=block_n,
        DIRECT=direct, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)
    if not direct:
        _combine_kernel[(num_rows, num_heads)](
            part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), num_splits, D=dim, S_PAD=triton.next_power_of_2(num_splits))
    return out


@triton.jit
def _store_kv_kernel(K, V, KC, VC, PAGE, OFF, s_kn, s_kh, s_vn, s_vh, s_cp, s_ch, s_cs, D: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    page = tl.load(PAGE + n)
    off = tl.load(OFF + n)
    dst = page * s_cp + h * s_ch + off * s_cs + d
    tl.store(KC + dst, tl.load(K + n * s_kn + h * s_kh + d))
    tl.store(VC + dst, tl.load(V + n * s_vn + h * s_vh + d))


def store_kv(keys: torch.Tensor, values: torch.Tensor, page: torch.Tensor, offset: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [N, Hkv, D] into keys/values [P, Hkv, page, D] (same strides) at (page[i], offset[i])."""
    num, num_kv, dim = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or keys.stride() != values.stride():
        raise ValueError("store_kv: head dim must be contiguous and keys/values laid out alike")
    _store_kv_kernel[(num, num_kv)](k, v, keys, values, page, offset, k.stride(0), k.stride(1), v.stride(0),
                                   v.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), D=dim, num_warps=1)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(LOGITS, s_lb, INV_T, GREEDY, THR, SEED, POS, TOK, LP, V, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    inv_t = tl.load(INV_T + b)
    greedy = tl.load(GREEDY + b) != 0
    thr = tl.load(THR + b)
    seed = tl.load(SEED + b).to(tl.uint32)
    pos = tl.load(POS + b).to(tl.uint32)
    key = _mix32(seed ^ _mix32(pos + 0x632BE5AB))
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    mx = tl.full([], float("-inf"), tl.float32)
    se = tl.full([], 0.0, tl.float32)
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        v = start + offs
        vm = v < V
        x = tl.load(LOGITS + b * s_lb + v, mask=vm, other=float("-inf")).to(tl.float32)
        sc = x * inv_t
        tile_max = tl.max(sc, 0)
        new_mx = tl.maximum(mx, tile_max)
        se = se * tl.exp(mx - new_mx) + tl.sum(tl.where(vm, tl.exp(sc - new_mx), 0.0), 0)
        mx = new_mx
        h = _mix32(key ^ (v.to(tl.uint32) * 0x9E3779B9))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(greedy, x, sc - tl.log(-tl.log(u)))      # log p - log E, E = -log u
        score = tl.where(vm & (sc >= thr), score, float("-inf"))
        tile_best, tile_idx = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
        better = tile_best > best
        best_idx = tl.where(better, start + tile_idx, best_idx)
        best = tl.where(better, tile_best, best)
    chosen = tl.load(LOGITS + b * s_lb + best_idx).to(tl.float32) * inv_t
    tl.store(TOK + b, best_idx.to(tl.int64))
    tl.store(LP + b, chosen - (mx + tl.log(se)))


def sample_tokens(logits: torch.Tensor, inv_temperature: torch.Tensor, greedy: torch.Tensor,
                  thresholds: torch.Tensor, seed32: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype, last dim contiguous) -> (tokens [B] int64, log_probs [B] float32).
    thresholds: [B] float32, -inf where nothing is cut."""
    num_rows, vocab = logits.shape
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    log_probs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    _sample_kernel[(num_rows,)](logits, logits.stride(0), inv_temperature, greedy, thresholds, seed32, positions,
                                tokens, log_probs, vocab, BLOCK=2048, num_warps=8)
    return tokens, log_probs
