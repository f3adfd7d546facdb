"""An experiment: paged decode attention on CUDA cores (no tl.dot), beside the engine's kernel (device).

Why: the engine's kernel (furlong/engine/kernels.py) runs Q.K^T and P.V as tensor-core dots with the
query rows padded to 16, which for GQA groups of 2 (Qwen3-0.6B) or 4 (4B, 8B) computes 8x or 4x the
useful products; that is free for bf16 K/V but an fp8 tile must go through shared memory to reach a dot
operand, and there it reads at ~2.5 TB/s-equivalent on an H200 (bf16: ~4.5), so fp8 K/V does not
speed decode up on an H200 (BENCHMARKS.md, session 9). Here each program holds its GROUP query heads as
a [G, 1, D] block and a K/V tile as [1, N, D], both loaded straight into registers in one layout, and
computes the scores and P.V with multiplies and reductions: no shared-memory round trip for the tile,
and only the useful products. Per tile of N tokens: G x N x D multiply-adds each for Q.K^T and P.V.
ACC3 keeps the P.V products unreduced ([G, N, D] accumulators, summed once at the end) so that the
per-tile reduction over N, which crosses threads, is not paid per tile.

The same splits and the same combine kernel as the engine's (row programs only: no cascade groups).
    python3 bench/decode_fma_kernel.py [--batch 256] [--context 640,4096] [--out DIR]
writes DIR/decode_fma_kernel.json: per (batch, context, kv dtype) the engine kernel's time and each
FMA setting's, with its largest difference from the engine kernel's output.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch
import triton
import triton.language as tl

from furlong.engine.kernels import _combine_kernel, paged_decode_attention

LOG2E = 1.4426950408889634


@triton.jit
def _decode_fma_kernel(Q, K, V, KS, VS, BT, CL, PL, O, LSE, OUT,
                       s_qb, s_qh, s_kp, s_kh, s_ks, s_sp, s_sh, s_bt, s_ob, s_oh, s_os, s_lb, s_lh, s_outb, s_outh,
                       scale_log2, num_splits,
                       G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                       DIRECT: tl.constexpr, FP8: tl.constexpr, ACC3: tl.constexpr, HAS_LO: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    g = tl.arange(0, G)[:, None, None]          # [G, 1, 1]
    n = tl.arange(0, BLOCK_N)[None, :, None]    # [1, N, 1]
    d = tl.arange(0, D)[None, None, :]          # [1, 1, D]
    hi = tl.load(CL + row)
    lo = tl.load(PL + row) if HAS_LO else 0     # cascade: the row's tokens after its group's shared prefix
    t_lo = lo // BLOCK_N
    num_tiles = tl.cdiv(hi, BLOCK_N)
    per_split = tl.cdiv(num_tiles - t_lo, num_splits)
    t0 = t_lo + sp * per_split
    t1 = tl.minimum(t0 + per_split, num_tiles)
    # scores in log2 units (exp2 below): the softmax scale and log2(e) folded into q once
    q = tl.load(Q + row * s_qb + (kvh * G + g) * s_qh + d).to(tl.float32) * scale_log2   # [G, 1, D]
    m = tl.full([G, 1, 1], float("-inf"), tl.float32)
    l = tl.zeros([G, 1, 1], tl.float32)
    if ACC3:
        acc = tl.zeros([G, BLOCK_N, D], tl.float32)
    else:
        acc = tl.zeros([G, 1, D], tl.float32)
    for t in range(t0, t1):
        start = t * BLOCK_N
        page = tl.load(BT + row * s_bt + start // PAGE).to(tl.int64)
        off = page * s_kp + kvh * s_kh + (start % PAGE + n) * s_ks + d          # [1, N, D]
        valid = ((start + n) < hi) & ((start + n) >= lo)                         # [1, N, 1]
        k = tl.load(K + off, mask=valid, other=0.0).to(tl.float32)
        v = tl.load(V + off, mask=valid, other=0.0).to(tl.float32)
        s = tl.sum(q * k, axis=2, keep_dims=True)                                # [G, N, 1]
        if FP8:
            s_off = page * s_sp + kvh * s_sh + start % PAGE + n                  # [1, N, 1]
            s = s * tl.load(KS + s_off, mask=valid, other=0.0)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1, keep_dims=True))                 # finite: the tile holds a token
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, axis=1, keep_dims=True)
        if FP8:
            p = p * tl.load(VS + s_off, mask=valid, other=0.0)
        if ACC3:
            acc = acc * alpha + p * v
        else:
            acc = acc * alpha + tl.sum(p * v, axis=1, keep_dims=True)
        m = m_new
    if ACC3:
        acc = tl.sum(acc, axis=1, keep_dims=True)
    has = l > 0
    safe = tl.where(has, l, 1.0)
    out = acc / safe                                                              # [G, 1, D]
    heads = kvh * G + g
    if DIRECT:
        tl.store(OUT + row * s_outb + heads * s_outh + d, out.to(OUT.dtype.element_ty))
    else:
        tl.store(O + row * s_ob + heads * s_oh + sp * s_os + d, out)
        # natural-log LSE, as the combine kernel reads it ([G, 1, 1])
        tl.store(LSE + row * s_lb + heads * s_lh + sp, tl.where(has, (m + tl.log2(safe)) * 0.6931471805599453,
                                                                float("-inf")))


def fma_rows(q, keys, values, block_tables, context_lens, num_splits, part, lse, out, prefix_lens, key_scales=None,
             value_scales=None, block_n=16, num_warps=1, num_stages=2, acc3=False):
    """The rows' own splits into paged_decode_attention's part/lse slots 0..num_splits-1 (or straight into
    out with one split and no cascade: part is out then)."""
    num_rows, num_heads, dim = q.shape
    _, num_kv, page, _ = keys.shape
    group = num_heads // num_kv
    if group & (group - 1) or page % block_n:
        raise ValueError(f"fma_rows: group {group} must be a power of 2, page {page} a multiple of {block_n}")
    fp8 = key_scales is not None
    ks, vs = (key_scales, value_scales) if fp8 else (context_lens, context_lens)
    direct = part is out
    pl = prefix_lens if prefix_lens is not None else context_lens
    _decode_fma_kernel[(num_rows, num_kv, num_splits)](
        q, keys, values, ks, vs, block_tables, context_lens, pl, part, lse, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        ks.stride(0) if fp8 else 0, ks.stride(1) if fp8 else 0, block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2) if not direct else 0, lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), LOG2E / math.sqrt(dim), num_splits,
        G=group, D=dim, PAGE=page, BLOCK_N=block_n, DIRECT=direct, FP8=fp8, ACC3=acc3,
        HAS_LO=prefix_lens is not None, num_warps=num_warps, num_stages=num_stages)


def fma_decode_attention(q, keys, values, block_tables, context_lens, num_splits, block_n=16, key_scales=None,
                         value_scales=None, num_warps=1, num_stages=2, acc3=False, prefix=None, group_splits=1,
                         **_engine_settings):
    """paged_decode_attention's contract (cascade groups still run on the engine's kernel)."""
    def rows(part, lse, out, pl):
        fma_rows(q, keys, values, block_tables, context_lens, num_splits, part, lse, out, pl, key_scales,
                 value_scales, block_n, num_warps, num_stages, acc3)
    return paged_decode_attention(q, keys, values, block_tables, context_lens, num_splits, prefix=prefix,
                                  group_splits=group_splits, key_scales=key_scales, value_scales=value_scales,
                                  rows_kernel=rows)


def main() -> None:
    from decode_kernel_sweep import build, engine_splits, time_graph   # bench/ (run from the repo root)
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="256")
    ap.add_argument("--context", default="640,4096")
    ap.add_argument("--block-n", default="16,32")
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--splits", default="engine", help="engine (ModelRunner's count) or engine,double")
    ap.add_argument("--out", default=".")
    ap.add_argument("--rollout", default=None, metavar="WORKLOAD",
                    help="then time `furlong bench --parts rollout` on this workload with fp8 KV, the engine's "
                         "kernel and then the best fp8 FMA setting of this sweep's longest context patched in")
    a = ap.parse_args()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for batch, context in itertools.product(map(int, a.batch.split(",")), map(int, a.context.split(","))):
        splits = engine_splits(batch, num_sms)
        for fp8 in (False, True):
            q, k, v, ks, vs, tables, lens, nbytes = build(batch, context, fp8, gen)
            scales = dict(key_scales=ks, value_scales=vs) if fp8 else {}
            ref = paged_decode_attention(q, k, v, tables, lens, splits, **scales)
            eng_ms = time_graph(lambda: paged_decode_attention(q, k, v, tables, lens, splits, **scales))
            base = dict(batch=batch, context=context, kv="fp8" if fp8 else "bf16", splits=splits)
            results.append(dict(base, kernel="engine", ms=round(eng_ms, 4), tb_s=round(nbytes / eng_ms / 1e9, 3)))
            print(json.dumps(results[-1]), flush=True)
            for block_n, warps, acc3, sp in itertools.product(
                    [int(x) for x in a.block_n.split(",")], [int(x) for x in a.warps.split(",")], (False, True),
                    sorted({splits, splits * 2} if "double" in a.splits else {splits})):
                def fn():
                    return fma_decode_attention(q, k, v, tables, lens, sp, block_n=block_n, num_warps=warps,
                                                acc3=acc3, **scales)
                row = dict(base, kernel="fma", block_n=block_n, warps=warps, acc3=acc3, splits=sp)
                try:
                    err = (fn().float() - ref.float()).abs().max().item()
                    ms = time_graph(fn)
                except Exception as e:   # a setting Triton cannot compile (registers, shared memory): reported
                    results.append(dict(row, error=str(e).splitlines()[0][:200]))
                    print(json.dumps(results[-1]), flush=True)
                    continue
                results.append(dict(row, ms=round(ms, 4), tb_s=round(nbytes / ms / 1e9, 3), max_diff=err,
                                    vs_engine=round(eng_ms / ms, 3)))
                print(json.dumps(results[-1]), flush=True)
            del q, k, v, ks, vs
            torch.cuda.empty_cache()
    print("best FMA setting per (batch, context, kv), against the engine's kernel:")
    for key in sorted({(r["batch"], r["context"], r["kv"]) for r in results}):
        rows = [r for r in results if (r["batch"], r["context"], r["kv"]) == key and "ms" in r]
        eng = next(r for r in rows if r["kernel"] == "engine")
        fma = [r for r in rows if r["kernel"] == "fma"]
        if fma:
            b = min(fma, key=lambda r: r["ms"])
            print(f"  B={key[0]} ctx={key[1]} {key[2]}: engine {eng['ms']:.3f} ms ({eng['tb_s']} TB/s); FMA "
                  f"{b['ms']:.3f} ms ({b['tb_s']} TB/s, {b['vs_engine']}x) at block_n {b['block_n']} warps "
                  f"{b['warps']} acc3 {b['acc3']} splits {b['splits']}, max diff {b['max_diff']:.2e}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "decode_fma_kernel.json").write_text(json.dumps(results, indent=1))
    if a.rollout:
        longest = max(r["context"] for r in results)
        fma = [r for r in results if r["kernel"] == "fma" and r["kv"] == "fp8" and r["context"] == longest
               and "ms" in r]
        best = min(fma, key=lambda r: r["ms"])
        rollout_side_by_side(a.rollout, Path(a.out), best)


def rollout_side_by_side(workload: str, out: Path, setting: dict) -> None:
    """The bench's rollout part with fp8 KV twice: the engine's kernel, then the FMA rows (`setting`'s
    block_n, warps, acc3; the engine's own split count) patched into the engine's attention call."""
    import furlong.engine.kernels as kernels
    from furlong.bench import run_bench
    engine_kernel = kernels.paged_decode_attention

    def patched(q, keys, values, block_tables, context_lens, num_splits, **kw):
        kw = {k: v for k, v in kw.items() if k in ("prefix", "group_splits", "key_scales", "value_scales")}
        return fma_decode_attention(q, keys, values, block_tables, context_lens, num_splits,
                                    block_n=setting["block_n"], num_warps=setting["warps"], acc3=setting["acc3"], **kw)
    for name, fn in (("engine", engine_kernel), ("fma", patched)):
        kernels.paged_decode_attention = fn      # kv_cache.DecodeContext.attend looks it up at each call
        try:
            print(f"[fma] rollout with the {name} kernel {setting if name == 'fma' else ''}", flush=True)
            run_bench(workload, str(out / f"rollout_fp8_{name}.json"), "rollout", "fp8_e4m3")
        finally:
            kernels.paged_decode_attention = engine_kernel


if __name__ == "__main__":
    main()
