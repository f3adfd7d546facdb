"""The paged decode attention kernel alone, bf16 against fp8 K/V, over its launch settings (device).

One layer of a Qwen3-0.6B-shaped cache (16 query heads, 8 KV heads, head_dim 128, 64-token pages,
the engine's page layout from kv_cache.KVLayout with 4 layers interleaved, pages in random order),
B rows at one context length; each setting is timed over CUDA-graph replays (median of 5 x 20)
and reported with the bandwidth it reaches over the K/V (+ scale) bytes it must read. fp8 V is
stored dim-major as the engine does (kv_cache.KVLayout.dim_major; `fp8_vtok`: token-major, the
earlier layout; `fp8_t`: the engine's layout read by the transposed kernel, kernels_transposed.py).
The engine's own setting is block_n 64, num_warps 4 (bf16), 1 (fp8, fp8_t) or 2 (fp8_vtok), V's load
beside K's for fp8, num_stages 2 and the split count of ModelRunner.num_splits (splits.program_splits). Tried and dropped (slower):
Q quantised to e4m3 for an fp8 x fp8 Q.K^T dot (no faster, 5x the output error), and K/V tiles dequantised in registers
before the dots (6x slower); e4m3 widened to fp16 where loaded by an inline-PTX convert, so the dots read
fp16 with ldmatrix (0.935 against 0.836 ms at B=256 x 4096 on an H100); the rows' own splits on
CUDA cores, no tl.dot (each program's GQA group as [G, 1, D] against [1, N, D] tiles, fp32 multiplies and
reductions: only the useful products, no shared-memory round trip), fp8 0.874x the engine kernel's speed
at its best setting and bf16 even (an H100; bench/decode_fma_kernel.py at commit f15a330); all KV heads of a
row in one program, the 16 query heads as the dots' unpadded rows (one Q.K_h^T and one P_h.V_h dot per KV
head, so the softmax covers no padding rows: ~64-75 SASS instructions per KB against ~101 offline), 0.76-0.95x
the engine kernel at its best setting (B=32/140/256 x 4096, an H100; bench/decode_packed_kernel.py at
commit d262666): fewer programs, each holding 8 heads' tiles, hid less latency than the instructions saved.

    python3 bench/decode_kernel_sweep.py [--batch 256,64] [--context 640,4096] [--warps 2,4,8] [--stages 1,2,3,4]
        [--quick | --block-n 32,64] [--kv bf16,fp8,fp8_vtok,fp8_t] [--out DIR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch

from furlong.engine.kernels import paged_decode_attention
from furlong.engine.kv_cache import KVLayout
from furlong.engine.kv_fp8 import FP8, quantize
from furlong.engine.splits import program_splits, programs_per_sm

HQ, HKV, D, PAGE, LAYERS = 16, 8, 128, 64, 4
ENGINE_WARPS = {"bf16": 4, "fp8": 1, "fp8_vtok": 2, "fp8_t": 1}   # paged_decode_attention's default (no cascade groups)


def engine_splits(rows: int, num_sms: int) -> int:
    """ModelRunner.num_splits's choice for B rows (splits.program_splits, the engine's split_rule)."""
    return program_splits(rows, HKV, num_sms)


def compiled_occupancy() -> list[dict]:
    """The decode kernel's compiled variants: registers, spills, shared memory and warps, and the
    programs one multiprocessor holds by them (what splits.resident_programs states)."""
    from furlong.engine.kernels import _decode_attn_kernel
    from furlong.engine.kernels_transposed import _decode_attn_transposed_kernel
    rows = []
    for name, fn in (("padded", _decode_attn_kernel), ("transposed", _decode_attn_transposed_kernel)):
        for cache in fn.device_caches.values():
            for k in cache[0].values():
                k._init_handles()
                warps, shared = k.metadata.num_warps, k.metadata.shared
                rows.append(dict(kernel=name, n_regs=k.n_regs, n_spills=k.n_spills, shared=shared, warps=warps,
                                 programs_per_sm=programs_per_sm(k.n_regs, warps, shared)))
    return rows


def build(batch: int, context: int, fp8: bool, gen: torch.Generator, v_dim_major: bool = True):
    pages_per_row = -(-context // PAGE)
    num_pages = batch * pages_per_row
    layout = KVLayout(LAYERS, HKV, PAGE, D, FP8 if fp8 else torch.bfloat16, fp8)
    kbuf = torch.empty(num_pages * layout.page_bytes, dtype=torch.uint8, device="cuda")
    vbuf = torch.empty_like(kbuf)
    (k, ks), (v, vs) = layout.views(kbuf, num_pages), layout.views(vbuf, num_pages, values=v_dim_major)
    k, v = k[:, 1], v[:, 1]                                   # one layer: strided like the engine's
    raw_k = torch.randn(num_pages, HKV, PAGE, D, device="cuda", generator=gen) * 2
    raw_v = torch.randn(num_pages, HKV, PAGE, D, device="cuda", generator=gen)
    if fp8:
        ks, vs = ks[:, 1], vs[:, 1]
        qk, sk = quantize(raw_k)
        qv, sv = quantize(raw_v)
        k.copy_(qk), v.copy_(qv), ks.copy_(sk), vs.copy_(sv)
    else:
        k.copy_(raw_k), v.copy_(raw_v)
    perm = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
    tables = perm.view(batch, pages_per_row)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    bytes_read = batch * context * HKV * 2 * (D * (1 if fp8 else 2) + (4 if fp8 else 0))
    return q, k, v, ks, vs, tables, lens, bytes_read


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def time_graph(fn) -> float:
    """Median ms per call over 5 batches of 20 graph replays."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 20)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="256,64")
    ap.add_argument("--context", default="640,4096")
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="block_n 64 only")
    ap.add_argument("--block-n", default=None, help="KV tile sizes (comma list; default 32,64, or 64 with --quick)")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="1,2,3,4")
    ap.add_argument("--splits", default=None,
                    help="split counts to time (default: the engine's rule's, half and double it)")
    ap.add_argument("--engine-launch", action="store_true",
                    help="warps and V's load order as the engine launches each kv (overrides --warps)")
    ap.add_argument("--kv", default="bf16,fp8,fp8_vtok",
                    help="bf16; fp8 (the engine's layout: V dim-major); fp8_vtok (V token-major, the earlier "
                         "layout); fp8_t (the engine's layout, the transposed kernel)")
    a = ap.parse_args()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for batch, context in itertools.product(map(int, a.batch.split(",")), map(int, a.context.split(","))):
        for kv in a.kv.split(","):
            fp8 = kv != "bf16"
            base = engine_splits(batch, num_sms)
            q, k, v, ks, vs, tables, lens, nbytes = build(batch, context, fp8, gen, v_dim_major=kv in ("fp8", "fp8_t"))
            transposed = kv == "fp8_t"
            ref = None
            grid = (ints(a.block_n) if a.block_n else (64,) if a.quick else (32, 64),
                    (ENGINE_WARPS[kv],) if a.engine_launch else ints(a.warps),
                    ints(a.stages), ints(a.splits) if a.splits else sorted({base, base * 2, max(1, base // 2)}),
                    (fp8,) if a.engine_launch or transposed else (False, True))   # transposed: no V-load choice
            for block_n, warps, stages, splits, early_v in itertools.product(*grid):
                def fn():
                    return paged_decode_attention(q, k, v, tables, lens, splits, block_n=block_n,
                                                  key_scales=ks if fp8 else None,
                                                  value_scales=vs if fp8 else None,
                                                  num_warps=warps, num_stages=stages, early_v=early_v,
                                                  transposed=transposed)
                try:
                    out = fn()
                    ref = out if ref is None else ref
                    err = (out.float() - ref.float()).abs().max().item()
                    ms = time_graph(fn)
                except Exception as e:   # a setting Triton cannot compile (shared memory): reported
                    results.append(dict(batch=batch, context=context, kv=kv,
                                        block_n=block_n, warps=warps, stages=stages, splits=splits, early_v=early_v,
                                        error=str(e).splitlines()[0][:200]))
                    continue
                row = dict(batch=batch, context=context, kv=kv, block_n=block_n,
                           warps=warps, stages=stages, splits=splits, early_v=early_v, ms=round(ms, 4),
                           tb_s=round(nbytes / ms / 1e9, 3), max_diff_vs_first=err,
                           engine_setting=(block_n, warps, stages, splits, early_v) ==
                           (64, ENGINE_WARPS[kv], 2, base, fp8))
                results.append(row)
                print(json.dumps(row), flush=True)
            del q, k, v, ks, vs
            torch.cuda.empty_cache()
    best = {}
    for r in results:
        if "ms" in r:
            key = (r["batch"], r["context"], r["kv"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    print("best per (batch, context, kv):")
    for r in best.values():
        eng = next((x for x in results if x.get("engine_setting") and
                    (x["batch"], x["context"], x["kv"]) == (r["batch"], r["context"], r["kv"])), None)
        eng_text = f"engine {eng['ms']:.3f} ms ({eng['tb_s']} TB/s)" if eng else "engine setting not swept"
        by_splits = {x["splits"]: x["ms"] for x in results if "ms" in x and x["block_n"] == r["block_n"] and
                     (x["batch"], x["context"], x["kv"], x["warps"], x["stages"], x["early_v"]) ==
                     (r["batch"], r["context"], r["kv"], r["warps"], r["stages"], r["early_v"])}
        print(f"  B={r['batch']} ctx={r['context']} {r['kv']}: {eng_text}; "
              f"best {r['ms']:.3f} ms ({r['tb_s']} TB/s) at block_n {r['block_n']} warps {r['warps']} "
              f"stages {r['stages']} splits {r['splits']} early_v {r['early_v']}; ms by splits at that setting: "
              + " ".join(f"{k}:{v:.4f}" for k, v in sorted(by_splits.items())))
    for occ in compiled_occupancy():
        print("compiled:", json.dumps(occ))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "decode_kernel_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
