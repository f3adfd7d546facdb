"""Where one decode step's time goes (device), kernels grouped by kind.

B rows at one context on random Qwen3-0.6B weights, profiled with torch.profiler over eager steps
(the same kernels the CUDA graph replays), kernels grouped by kind; plus the graphed step's time
with cascade attention on and off (alternating, 3 each, same rows).

    python3 bench/profile_decode.py [--batch 256] [--context 384] [--prompt P] [--group N] [--no-cascade]
        [--kv-dtype bf16,fp8_e4m3] [--fuse-prologue off|on|both] [--residual-add pointwise|addmm|both]
        [--overlap-rows N] [--out DIR]
--group N: the B rows are B/N requests of N samples each (one shared prompt per request: cascade
attention reads it once per group unless --no-cascade); default 1, every row its own prompt.
--kv-dtype: the KV cache's dtype (EngineConfig.kv_dtype); a comma list profiles each in turn, same
rows and weights, one engine after the other: profile_decode.json holds one result per dtype
under "runs" (a single dtype: that result alone, as before).
--residual-add addmm: the engine's residual adds written as a plain `x + y`, which the compiler folds into
the projections' matmuls (cuBLAS addmm, each with a copy of x): the layout before forward.add_residual,
for a side-by-side figure (the compiled code is reset between the two).
--overlap-rows N: the graphed step is also timed with windows of >= N rows as two halves on two streams
(engine/overlap.py), alternating with the whole batch on the same rows ("graphed_step_ms_halves"; with
--group, cascade groups are planned within each half).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

import furlong.engine.forward as engine_forward

from furlong.bench.state import NullTokenizer
from furlong.bench.workload import load_workload
from furlong.engine import Engine, EngineConfig, Request, SamplingParams
from furlong.engine.cascade import plan_groups
from furlong.models.decoder import Transformer
from furlong.models.hf_config import ModelArgs

KINDS = (("attention (paged decode)", ("_decode_attn", "_combine")), ("sampler", ("_sample_",)),
         ("matmul", ("gemm", "gemv", "cutlass", "sm90", "nvjet", "cublas")),
         ("KV write", ("_store_kv", "index_put", "indexing_backward", "index_elementwise")),
         ("fused norm/rope/silu (compiled)", ("triton_",)), ("copy/cast/elementwise", ("elementwise", "copy", "fill")))


STEPS = 24   # decode steps of head-room past the context


def kind(name: str) -> str:
    low = name.lower()
    for label, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return label
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-dtype", default="bf16", help="KV cache dtype(s), comma-separated: bf16, fp8_e4m3")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default: the whole context)")
    ap.add_argument("--group", type=int, default=1, help="samples per prompt (rows sharing one prompt)")
    ap.add_argument("--no-cascade", action="store_true", help="profile with cascade off (both are timed)")
    ap.add_argument("--fuse-prologue", choices=("off", "on", "both"), default="off",
                    help="ModelRunner.fuse_prologue (qk-norm, RoPE and the KV store in one kernel); both: "
                         "each dtype with it off, then on")
    ap.add_argument("--residual-add", choices=("pointwise", "addmm", "both"), default="pointwise",
                    help="pointwise: the engine's forward.add_residual; addmm: a plain x + y (see above); both")
    ap.add_argument("--overlap-rows", type=int, default=0,
                    help="also time the graphed step as two halves (ModelRunner.overlap_min_rows; 0: not)")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    if a.overlap_rows < 0:
        ap.error(f"--overlap-rows: a row count >= 0, got {a.overlap_rows}")
    prompt_len = a.context if a.prompt is None else a.prompt
    if a.batch % a.group or not 0 < prompt_len <= a.context:
        ap.error(f"--group {a.group} must divide --batch {a.batch}; --prompt must be in [1, --context]")
    kv_dtypes = a.kv_dtype.split(",")
    w = load_workload(Path(__file__).with_name("seed_workload.json"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(ModelArgs.from_hf_config(w.model)).to(torch.bfloat16).eval()
    prompts = torch.randint(0, w.model["vocab_size"], (a.batch // a.group, prompt_len)).tolist()
    runs = []
    fused = {"off": [False], "on": [True], "both": [False, True]}[a.fuse_prologue]
    residual = {"pointwise": ["pointwise"], "addmm": ["addmm"], "both": ["addmm", "pointwise"]}[a.residual_add]
    pointwise_add = engine_forward.add_residual
    try:   # the module's add_residual is swapped per run: put back whatever happens
        for kv_dtype in kv_dtypes:
            try:
                cfg = EngineConfig(max_model_len=a.context + 4 * STEPS, max_num_seqs=a.batch, cascade_min_prefix=1,
                                   kv_dtype=kv_dtype)
            except ValueError as e:
                ap.error(str(e))
            for fuse in fused:
                for add in residual:
                    # the layer functions look add_residual up when compiled: set it, and compile afresh
                    engine_forward.add_residual = pointwise_add if add == "pointwise" else lambda x, y: x + y
                    torch._dynamo.reset()
                    runs.append(profile(model, cfg, prompts, a, prompt_len, fuse) | {"residual_add": add})
    finally:
        engine_forward.add_residual = pointwise_add
    res = runs[0] if len(runs) == 1 else {"runs": runs}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "profile_decode.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


def profile(model: Transformer, cfg: EngineConfig, prompts: list[list[int]], a: argparse.Namespace,
            prompt_len: int, fuse_prologue: bool = False) -> dict:
    """One engine at this config: rows decoded to the context, then timed and profiled."""
    # cascade_min_prefix 1 (cfg): the kernel is timed with and without groups whatever the prompt length
    eng = Engine(model, NullTokenizer(), [], cfg)
    eng.runner.fuse_prologue = fuse_prologue                # before the first window: graphs keep their path
    params = SamplingParams(temperature=1.0, max_new_tokens=a.context - prompt_len + 4 * STEPS, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add(Request(i, p, params, n=a.group, seed=i))
    while eng.scheduler.waiting:
        eng.step()                                  # prefill all rows (several packed prefills)
    eng.step()                                      # one graphed window (captures the bucket)
    while min(s.num_tokens for s in eng.scheduler.running) < a.context:
        eng.step()                                  # decode up to the context
    seqs = list(eng.scheduler.running)
    for s in seqs:                                  # pages for the windows run below, outside the scheduler
        eng.scheduler.blocks.grow(s.block_table, s.num_tokens + 32)
    runner = eng.runner
    variants = [(c, o) for c in (True, False) for o in sorted({0, a.overlap_rows})]
    graphed: dict[tuple[bool, int], list[float]] = {v: [] for v in variants}
    for _ in range(3):                              # cascade on and off (and halves), alternating, same rows
        for cascade, overlap in variants:
            runner.cascade, runner.overlap_min_rows = cascade, overlap
            runner.decode(seqs, 1)                  # captures this variant's graph on first use
            torch.cuda.synchronize()
            t = time.perf_counter()
            runner.decode(seqs, 8)                  # graphed: 8 replays, one sync
            graphed[cascade, overlap].append((time.perf_counter() - t) * 1000 / 8)
    runner.cascade, runner.overlap_min_rows = not a.no_cascade, 0
    runner.use_cuda_graphs = False
    runner.decode(seqs, 2)                          # eager warm-up at this batch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.decode(seqs, 4)
    per_kind: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    calls: dict[str, float] = defaultdict(float)     # launches per step: which are per layer (28), per step (1)
    for e in prof.key_averages():
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if us <= 0 or e.key.startswith("cuda"):    # runtime API entries, not kernels
            continue
        per_kind[kind(e.key)] += us / 4 / 1000
        per_kernel[e.key] += us / 4 / 1000
        calls[e.key] += e.count / 4
    total = sum(per_kind.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
    res = {"kv_dtype": cfg.kv_dtype, "fuse_prologue": fuse_prologue,
           "kv_bytes_per_token": eng.runner.page_bytes() / cfg.page_size,
           "batch": a.batch, "context": a.context, "prompt": prompt_len, "group": a.group,
           "grouped_rows": sum(1 for p in plan_groups(seqs, runner.members).prefix_lens if p > 0),
           "graphed_step_ms": sorted(graphed[runner.cascade, 0])[1], "graphed_step_ms_cascade": graphed[True, 0],
           "graphed_step_ms_no_cascade": graphed[False, 0], "profiled_cascade": runner.cascade,
           **({"graphed_step_ms_halves": sorted(graphed[runner.cascade, a.overlap_rows])[1],
               "graphed_step_ms_halves_all": graphed[runner.cascade, a.overlap_rows]} if a.overlap_rows else {}),
           "kernel_ms_per_step": total,
           "by_kind_ms": dict(sorted(per_kind.items(), key=lambda kv: -kv[1])),
           "top_kernels_ms": dict(top),
           "top_kernels_calls_per_step": {k: calls[k] for k, _ in top},
           "kernels_per_step": sum(calls.values())}
    runner.use_cuda_graphs = True
    for s in seqs:
        eng.scheduler.finish(s, "abort")            # the pages taken outside the scheduler go back too
    eng.release()
    return res


if __name__ == "__main__":
    main()
