"""An experiment: fp8 paged decode attention with all KV heads of a row in one program (device).

Why: the engine's kernel (furlong/engine/kernels.py) runs one program per (row, KV head), its GROUP
query heads padded to tl.dot's 16 rows. The dots cost the same either way, but every elementwise step
of the online softmax and the value scaling runs over all 16 rows: for Qwen3-0.6B's GROUP of 2, 7 of
8 are padding. bf16 hides that behind memory; an fp8 tile brings half the bytes for the same
instructions, and the SASS of its loop (bench/kernel_sass.py, 1 warp) is ~42% such elementwise work.
Here a program holds all HQ query heads of its row as the dot's M rows (16 for 0.6B, 32 for 4B/8B:
none padded) and, per tile of BLOCK_N tokens, runs one Q.K_h^T dot per KV head h over all HQ rows,
keeping row r's scores only from its own head (a select): the products are the padded kernel's, the
softmax and scaling work 1/8 of it. P.V likewise: per head, P with the other heads' rows zeroed, dotted
with V_h and accumulated into ONE [HQ, D] accumulator (row r receives only its own head's values).
The value scales are applied relative to a per-row unit c (the tile's largest scale of the row's head,
never below 2^-24 of the previous unit), so p * scale / c stays in fp16's range and the accumulator is
rescaled once per tile (alpha * c_old / c_new) inside the dot's accumulate, not multiplied twice.

fp8 only, V dim-major (the engine's layout), row programs only (no cascade groups), splits over the KV
length with the engine's combine kernel. Not used by the engine: its sweep decides (next device call).
    python3 bench/decode_packed_kernel.py [--batch 256,32] [--context 640,4096] [--out DIR] [--rollout W]
writes DIR/decode_packed_kernel.json: per (batch, context) the engine kernel's time and each packed
setting's (block_n, warps, stages, splits), with its largest difference from the engine kernel's output;
--rollout W then runs the bench's rollout part on workload W with each kernel (rollout_fp8_*.json).
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

from furlong.engine.kernels import _combine_kernel
from furlong.engine.kv_cache import value_layout


@triton.jit
def _packed_decode_kernel(Q, K, V, KS, VS, BT, CL, O, LSE, OUT,
                          s_qb, s_qh, s_kp, s_kh, s_ks, s_sp, s_sh, s_bt, s_ob, s_oh, s_os, s_lb, s_lh,
                          s_outb, s_outh, scale, num_splits,
                          HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                          BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, DOT: tl.constexpr,
                          PRECISION: tl.constexpr):
    row = tl.program_id(0)
    sp = tl.program_id(1)
    r = tl.arange(0, HQ)
    head = r // (HQ // HKV)                               # [HQ] each query row's KV head
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    hi = tl.load(CL + row)
    num_tiles = tl.cdiv(hi, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    t0 = sp * per_split
    t1 = tl.minimum(t0 + per_split, num_tiles)
    q = tl.load(Q + row * s_qb + r[:, None] * s_qh + d[None, :]).to(DOT)     # [HQ, D]
    m = tl.full([HQ], float("-inf"), tl.float32)
    l = tl.zeros([HQ], tl.float32)
    c = tl.zeros([HQ], tl.float32)                        # acc's unit per row: acc * c is the true sum
    acc = tl.zeros([HQ, D], tl.float32)
    for t in range(t0, t1):
        start = t * BLOCK_N
        page = tl.load(BT + row * s_bt + start // PAGE).to(tl.int64)
        tok = tl.multiple_of(start % PAGE, BLOCK_N)
        valid = (start + n) < hi
        base = page * s_kp
        s = tl.zeros([HQ, BLOCK_N], tl.float32)
        for h in tl.static_range(HKV):
            k = tl.load(K + base + h * s_kh + (tok + n)[:, None] * s_ks + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.where((head == h)[:, None], tl.dot(q, tl.trans(k.to(DOT)), input_precision=PRECISION), s)
        sc_off = page * s_sp + head[:, None] * s_sh + (tok + n)[None, :]                # [HQ, BLOCK_N]
        s = s * (tl.load(KS + sc_off, mask=valid[None, :], other=0.0) * scale)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))               # finite: every tile in range holds a valid token
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        vsc = tl.load(VS + sc_off, mask=valid[None, :], other=0.0)
        c_new = tl.maximum(tl.maximum(tl.max(vsc, 1), c * 5.9604644775390625e-08), 1e-30)   # 2^-24
        pv = (p * (vsc / c_new[:, None])).to(DOT)
        acc = acc * (alpha * (c / c_new))[:, None]
        for h in tl.static_range(HKV):
            # dim-major V: tokens contiguous, read whole (slots past the context hold finite values)
            v = tl.load(V + base + h * s_kh + (tok + n)[:, None] + d[None, :] * PAGE)
            acc = tl.dot(tl.where((head == h)[:, None], pv, 0.0).to(DOT), v.to(DOT), acc, input_precision=PRECISION)
        m = m_new
        c = c_new
    has = l > 0
    safe = tl.where(has, l, 1.0)
    out = acc * (c / safe)[:, None]
    if DIRECT:
        tl.store(OUT + row * s_outb + r[:, None] * s_outh + d[None, :], out.to(OUT.dtype.element_ty))
    else:
        tl.store(O + row * s_ob + r[:, None] * s_oh + sp * s_os + d[None, :], out)
        tl.store(LSE + row * s_lb + r * s_lh + sp, tl.where(has, m + tl.log(safe), float("-inf")))


def packed_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, num_splits: int, key_scales: torch.Tensor,
                            value_scales: torch.Tensor, block_n: int = 16, num_warps: int = 4,
                            num_stages: int = 2) -> torch.Tensor:
    """As kernels.paged_decode_attention without cascade groups, for an fp8 cache with dim-major values:
    q [B, Hq, D]; keys/values [num_pages, Hkv, page, D] float8_e4m3fn; key/value_scales [num_pages, Hkv,
    page] float32 -> [B, Hq, D] in q's dtype (zeros where context_lens is 0)."""
    num_rows, num_heads, dim = q.shape
    _, num_kv, page, _ = keys.shape
    if not value_layout(keys, values) or key_scales.stride() != value_scales.stride() or key_scales.stride(-1) != 1:
        raise ValueError("packed_decode_attention: values must be dim-major, scales laid out alike, tokens contiguous")
    if num_heads < 16 or num_heads & (num_heads - 1) or page % block_n or q.stride(-1) != 1:
        raise ValueError(f"packed_decode_attention: {num_heads} query heads (a power of 2 >= 16), page {page} "
                         f"a multiple of {block_n}")
    out = torch.empty_like(q)
    direct = num_splits == 1
    if direct:
        part, lse = out, out   # unused
    else:
        part = torch.empty(num_rows, num_heads, num_splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _packed_decode_kernel[(num_rows, num_splits)](
        q, keys, values, key_scales, value_scales, block_tables, context_lens, part, lse, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), key_scales.stride(0),
        key_scales.stride(1), block_tables.stride(0), part.stride(0), part.stride(1),
        part.stride(2) if not direct else 0, lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        1.0 / math.sqrt(dim), num_splits, HQ=num_heads, HKV=num_kv, D=dim, PAGE=page, BLOCK_N=block_n,
        DIRECT=direct, DOT=tl.float32 if q.dtype == torch.float32 else tl.float16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    if not direct:
        _combine_kernel[(num_rows, num_heads)](
            part, lse, out, context_lens, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
            lse.stride(1), out.stride(0), out.stride(1), num_splits, 0, D=dim,
            S_PAD=triton.next_power_of_2(num_splits), CASCADE=False)
    return out


def main() -> None:
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_kernel_sweep import build, engine_splits, time_graph

    from furlong.engine.kernels import paged_decode_attention
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="256,32")
    ap.add_argument("--context", default="640,4096")
    ap.add_argument("--block-n", default="16,32")
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--out", default=".")
    ap.add_argument("--rollout", default=None, metavar="WORKLOAD",
                    help="then time `furlong bench --parts rollout` on this workload with fp8 KV twice: the engine's "
                         "kernel, then the packed one at the sweep's best setting for B=256 at the longest context")
    a = ap.parse_args()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for batch, context in itertools.product(map(int, a.batch.split(",")), map(int, a.context.split(","))):
        q, k, v, ks, vs, tables, lens, nbytes = build(batch, context, True, gen, v_dim_major=True)
        base = engine_splits(batch, num_sms)
        ref = paged_decode_attention(q, k, v, tables, lens, base, key_scales=ks, value_scales=vs)
        engine_ms = time_graph(lambda: paged_decode_attention(q, k, v, tables, lens, base, key_scales=ks,
                                                              value_scales=vs))
        row = dict(batch=batch, context=context, engine_ms=round(engine_ms, 4), engine_tb_s=round(nbytes / engine_ms / 1e9, 3))
        print(json.dumps(row), flush=True)
        # programs are rows x splits here (no KV-head axis): 8x fewer than the engine's at a split count
        for block_n, warps, stages, splits in itertools.product(
                map(int, a.block_n.split(",")), map(int, a.warps.split(",")), map(int, a.stages.split(",")),
                sorted({base, base * 4, base * 8, min(64, base * 16)})):
            def fn():
                return packed_decode_attention(q, k, v, tables, lens, splits, ks, vs, block_n=block_n,
                                               num_warps=warps, num_stages=stages)
            setting = dict(batch=batch, context=context, block_n=block_n, warps=warps, stages=stages, splits=splits)
            try:
                err = (fn().float() - ref.float()).abs().max().item()
                ms = time_graph(fn)
            except Exception as e:   # a setting Triton cannot compile (shared memory, registers): reported
                results.append(dict(setting, error=str(e).splitlines()[0][:200]))
                continue
            r = dict(setting, ms=round(ms, 4), tb_s=round(nbytes / ms / 1e9, 3), vs_engine=round(engine_ms / ms, 3),
                     max_diff_vs_engine=err, engine_ms=row["engine_ms"])
            results.append(r)
            print(json.dumps(r), flush=True)
        del q, k, v, ks, vs
        torch.cuda.empty_cache()
    print("best packed setting per (batch, context):")
    for key in sorted({(r["batch"], r["context"]) for r in results if "ms" in r}):
        best = min((r for r in results if "ms" in r and (r["batch"], r["context"]) == key), key=lambda r: r["ms"])
        print(f"  B={key[0]} ctx={key[1]}: engine {best['engine_ms']:.3f} ms; packed {best['ms']:.3f} ms "
              f"({best['tb_s']} TB/s, {best['vs_engine']}x) at block_n {best['block_n']} warps {best['warps']} "
              f"stages {best['stages']} splits {best['splits']}; max diff {best['max_diff_vs_engine']:.2e}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "decode_packed_kernel.json").write_text(json.dumps(results, indent=1))
    if a.rollout:
        ok = [r for r in results if "ms" in r]
        top = max(r["batch"] for r in ok)
        longest = max(r["context"] for r in ok if r["batch"] == top)
        best = min((r for r in ok if r["batch"] == top and r["context"] == longest), key=lambda r: r["ms"])
        rollout_side_by_side(a.rollout, Path(a.out), best)


def rollout_side_by_side(workload: str, out: Path, setting: dict) -> None:
    """The bench's rollout part with fp8 KV twice: the engine's kernel, then the packed one patched into
    the engine's attention call where it applies (no cascade groups, dim-major fp8 values), with
    `setting`'s block_n and warps and its programs per row scaled to the batch: splits = the power of two
    nearest above setting's rows x splits / rows, at most 64."""
    import furlong.engine.kernels as kernels
    from furlong.bench import run_bench
    engine_kernel = kernels.paged_decode_attention
    programs = setting["batch"] * setting["splits"]

    def patched(q, keys, values, block_tables, context_lens, num_splits, **kw):
        if kw.get("prefix") is not None or kw.get("key_scales") is None or q.shape[1] < 16:
            return engine_kernel(q, keys, values, block_tables, context_lens, num_splits, **kw)
        splits = min(64, 1 << (max(1, -(-programs // q.shape[0])) - 1).bit_length())
        return packed_decode_attention(q, keys, values, block_tables, context_lens, splits, kw["key_scales"],
                                       kw["value_scales"], block_n=setting["block_n"], num_warps=setting["warps"],
                                       num_stages=setting["stages"])
    for name, fn in (("engine", engine_kernel), ("packed", patched)):
        kernels.paged_decode_attention = fn      # kv_cache.DecodeContext.attend looks it up at each call
        try:
            print(f"[packed] rollout with the {name} kernel {setting if name == 'packed' else ''}", flush=True)
            run_bench(workload, str(out / f"rollout_fp8_{name}.json"), "rollout", "fp8_e4m3")
        finally:
            kernels.paged_decode_attention = engine_kernel


if __name__ == "__main__":
    main()
