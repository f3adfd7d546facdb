"""Where one decode step's time goes (device), kernels grouped by kind.

The decode probe's shape (B rows, mean context prompt + new/2) on random Qwen3-0.6B weights, profiled with torch.profiler over eager steps
(the same kernels the CUDA graph replays), kernels grouped by kind; plus the graphed step's time.

    python3 bench/profile_decode.py [--batch 256] [--context 384] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from furlong.bench.state import NullTokenizer
from furlong.bench.workload import load_workload
from furlong.engine import Engine, EngineConfig, Request, SamplingParams
from furlong.models.decoder import Transformer
from furlong.models.hf_config import ModelArgs

KINDS = (("attention (paged decode)", ("_decode_attn", "_combine")), ("sampler", ("_sample_kernel",)),
         ("matmul", ("gemm", "gemv", "cutlass", "sm90", "nvjet", "cublas")),
         ("KV write (index_put)", ("index_put", "indexing_backward", "index_elementwise")),
         ("fused norm/rope/silu (compiled)", ("triton_",)), ("copy/cast/elementwise", ("elementwise", "copy", "fill")))


def kind(name: str) -> str:
    low = name.lower()
    for label, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return label
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    w = load_workload(Path(__file__).with_name("seed_workload.json"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(ModelArgs.from_hf_config(w.model)).to(torch.bfloat16).eval()
    prompt_len, steps = a.context, 24
    eng = Engine(model, NullTokenizer(), [], EngineConfig(max_model_len=prompt_len + 4 * steps,
                                                          max_num_seqs=a.batch))
    prompts = torch.randint(0, w.model["vocab_size"], (a.batch, prompt_len)).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=4 * steps, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add(Request(i, p, params, seed=i))
    while eng.scheduler.waiting:
        eng.step()                                  # prefill all rows (several packed prefills)
    eng.step()                                      # one graphed window (captures the bucket)
    seqs = list(eng.scheduler.running)
    for s in seqs:                                  # pages for the windows run below, outside the scheduler
        eng.scheduler.blocks.grow(s.block_table, s.num_tokens + 32)
    runner = eng.runner
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = runner.decode(seqs, 8)                    # graphed: 8 replays, one sync
    graphed_ms = (time.perf_counter() - t) * 1000 / 8
    runner.use_cuda_graphs = False
    runner.decode(seqs, 2)                          # eager warm-up at this batch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.decode(seqs, 4)
    del out
    per_kind: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if us <= 0 or e.key.startswith("cuda"):    # runtime API entries, not kernels
            continue
        per_kind[kind(e.key)] += us / 4 / 1000
        per_kernel[e.key] += us / 4 / 1000
    total = sum(per_kind.values())
    res = {"batch": a.batch, "context": a.context, "graphed_step_ms": graphed_ms, "kernel_ms_per_step": total,
           "by_kind_ms": dict(sorted(per_kind.items(), key=lambda kv: -kv[1])),
           "top_kernels_ms": dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15])}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "profile_decode.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
