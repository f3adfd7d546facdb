"""Where one train step's time goes (device): kernels grouped by kind, and the GPU's idle time.

The bench's seed step (random Qwen3-0.6B, 256 samples, --max-tokens-per-gpu 32768), one warm-up
train_step, then one profiled with torch.profiler (CUDA kernels only). Kinds are matched on kernel
names; "idle" is the step's wall time minus the union of kernel intervals (host gaps: Python,
launches, syncs). Also times the step unprofiled (the median of 3).

    python3 bench/profile_train.py [--out DIR] [--label NAME] [--budget 32768] [--recompute]
                                   [--reshard-after-forward] [--host] [--old LEVER,...]
--host also records CPU ops (with input shapes and Python stacks) in the profiled step and writes
tables to DIR/profile_train_NAME_ops.txt: ops by device time (which aten op launched the copies
and fills), by host time (where the GPU's idle time comes from) and by Python stack. The
profiler's own host cost inflates that step's idle time: read the idle figure from a run without --host.
--old puts levers of the train step back to what they replaced, to measure each one side by side:
  keep_logits  recompute every LM-head chunk's logits in backward (logprobs.py)
  gqa          expand K/V heads for the flash kernel instead of GQA inside it (attention.py)
  addmm        accumulate the LM-head weight gradient with a separate fp32 add per chunk
Writes DIR/profile_train_NAME.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from furlong.bench.measure import peak_gib, reset_peak
from furlong.bench.state import Bench
from furlong.bench.workload import load_workload

# First match wins; the names are those of cuBLAS/CUTLASS, flash-attention, torch's eager kernels
# and inductor's generated Triton kernels (triton_poi/red/per_...).
KINDS = (
    ("attention (flash fwd/bwd)", ("flash", "fmha", "attention")),
    ("matmul", ("gemm", "gemv", "cutlass", "sm90_", "nvjet", "cublas", "xmma")),
    ("optimizer (adam)", ("adam", "multi_tensor_apply")),
    ("FSDP copy-in/out, casts", ("chunk_cat", "split_with_sizes", "foreach_copy", "all_gather", "reduce_scatter",
                                 "nccl")),
    ("compiled elementwise (triton)", ("triton_",)),
    ("index/gather/scatter", ("index", "gather", "scatter")),
    ("reductions (eager)", ("reduce_kernel", "norm_kernel")),
    ("eager elementwise/copies", ("elementwise", "copy", "fill", "cat")),
)


def kind(name: str) -> str:
    low = name.lower()
    for label, keys in KINDS:
        if any(k in low for k in keys):
            return label
    return "other"


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (us)."""
    total, end_max = 0.0, None
    for s, e in sorted(intervals):
        if end_max is None or s > end_max:
            total += e - s
            end_max = e
        elif e > end_max:
            total += e - end_max
            end_max = e
    return total


def _old_keep_logits(actor) -> None:
    actor.keep_logits_bytes = 0


def _old_gqa(actor) -> None:
    from furlong.models import attention
    pick = attention.select_packed_impl
    attention.select_packed_impl = lambda q: "varlen" if pick(q) == "varlen_gqa" else pick(q)


def _old_addmm(actor) -> None:
    from furlong.train import logprobs

    def add_after(grad_w, gz, h):
        grad_w += gz.t() @ h
    logprobs._accumulate_weight_grad = add_after


# --old NAME -> what puts that lever back on the built actor, before its first (compiling) step;
# the module attributes are looked up at call time
OLD = {"keep_logits": _old_keep_logits, "gqa": _old_gqa, "addmm": _old_addmm}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--label", default="baseline")
    ap.add_argument("--budget", type=int, default=32768)
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--reshard-after-forward", action="store_true",
                    help="FSDP's default: re-gather each layer in backward and per micro-batch")
    ap.add_argument("--host", action="store_true", help="also profile CPU ops; write the ops tables")
    ap.add_argument("--old", default="", help="comma-separated levers to turn back (module docstring)")
    a = ap.parse_args()
    olds = [x for x in a.old.split(",") if x]
    unknown = sorted(set(olds) - set(OLD))
    if unknown:
        ap.error(f"--old: unknown lever(s) {', '.join(unknown)} (choose from {', '.join(OLD)})")
    b = Bench(load_workload(Path(__file__).with_name("seed_workload.json")))
    base_config = b.config

    def config(**kw):
        cfg = base_config(**{"gradient_checkpointing": a.recompute, **kw})
        cfg.parallel.fsdp_reshard_after_forward = a.reshard_after_forward
        return cfg
    b.config = config
    actor, samples, dev = b.actor(), b.train_samples(), b.device
    actor.max_tokens_per_gpu = a.budget
    for name in olds:
        OLD[name](actor)
    num_tokens = sum(s.num_tokens for s in samples)
    actor.train_step(samples)                                       # warm-up: compiles
    times = []
    reset_peak(dev)
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        tm = actor.train_step(samples)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = peak_gib(dev)
    step_s = statistics.median(times)
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if a.host:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities, record_shapes=a.host, with_stack=a.host) as prof:
        torch.cuda.synchronize()
        t = time.perf_counter()
        actor.train_step(samples)
        torch.cuda.synchronize()
        prof_wall = time.perf_counter() - t
    per_kind: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    intervals = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.name.startswith("cuda"):
            continue
        us = e.time_range.end - e.time_range.start
        if us <= 0:
            continue
        intervals.append((e.time_range.start, e.time_range.end))
        per_kind[kind(e.name)] += us / 1000
        per_kernel[e.name[:120]] += us / 1000
        counts[e.name[:120]] += 1
    busy_ms = _busy_us(intervals) / 1000
    res = {"label": a.label, "old": olds, "num_tokens": num_tokens, "budget": a.budget, "recompute": a.recompute,
           "reshard_after_forward": a.reshard_after_forward,
           "num_micro_batches": tm.num_micro_batches, "step_s_median3": step_s, "step_s_all": times,
           "tok_per_s": num_tokens / step_s, "peak_gib": peak, "profiled_wall_ms": prof_wall * 1000,
           "gpu_busy_ms": busy_ms, "gpu_idle_ms": prof_wall * 1000 - busy_ms,
           "kernel_ms_by_kind": dict(sorted(per_kind.items(), key=lambda kv: -kv[1])),
           "top_kernels_ms": {k: [round(v, 2), counts[k]] for k, v in
                              sorted(per_kernel.items(), key=lambda kv: -kv[1])[:40]}}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.host:
        by_shape = prof.key_averages(group_by_input_shape=True)
        tables = ["ops by device time (self), grouped by input shape",
                  by_shape.table(sort_by="self_device_time_total", row_limit=50, max_name_column_width=60),
                  "ops by host time (self)",
                  prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=50, max_name_column_width=60),
                  "ops by device time (self), grouped by Python stack (5 frames)",
                  prof.key_averages(group_by_stack_n=5).table(sort_by="self_device_time_total", row_limit=40,
                                                              max_name_column_width=60)]
        (Path(a.out) / f"profile_train_{a.label}_ops.txt").write_text("\n\n".join(tables))
    (Path(a.out) / f"profile_train_{a.label}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1), flush=True)


if __name__ == "__main__":
    main()
