"""Where one train step's time goes (device): kernels grouped by kind, and the GPU's idle time.

The bench's seed step (random Qwen3-0.6B, 256 samples, --max-tokens-per-gpu 32768), one warm-up
train_step, then one profiled with torch.profiler (CUDA kernels only). Kinds are matched on kernel
names; "idle" is the step's wall time minus the union of kernel intervals (host gaps: Python,
launches, syncs). Also times the step unprofiled (the median of 3).

    python3 bench/profile_train.py [--out DIR] [--label NAME] [--budget 32768] [--workload JSON] [--recompute]
                                   [--reshard-after-forward] [--host] [--old LEVER,...]
--host also records CPU ops (with input shapes and Python stacks) in the profiled step and writes
tables to DIR/profile_train_NAME_ops.txt: ops by device time (which aten op launched the copies
and fills), by host time (where the GPU's idle time comes from) and by Python stack. The
profiler's own host cost inflates that step's idle time: read the idle figure from a run without --host.
--old puts levers of the train step back to what they replaced, to measure each one side by side:
  keep_logits  recompute every LM-head chunk's logits in backward (logprobs.py)
  addmm        accumulate the LM-head weight gradient with a separate fp32 add per chunk
Host lead: each timed step also records when the host reaches the optimizer step (Trainer._finish, the
step's one sync) and when the GPU gets there: `host_s` is the host's time to queue the micro-batches'
forward and backward work, `gpu_s` the GPU's time to finish it; host_s < gpu_s means the GPU never
waited for the host over the whole step (it may still have in places), and the gap is the margin a
slower host has before the step gets slower.
--host-only runs the same step (layers, samples, micro-batches, vocabulary) on a model with tiny
layers (hidden 64), whose GPU work is a few ms: the step's time is then the host's work alone,
without waiting for the GPU (host_s above may include such waits: a full launch queue, a sync).
--find-syncs runs one more step under torch.cuda.set_sync_debug_mode("warn") and writes each
distinct call site that made the host wait for the device to DIR/profile_train_NAME_syncs.txt.
Writes DIR/profile_train_NAME.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import traceback
import warnings
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


def _merged(intervals: list[tuple[float, float]]) -> list[list[float]]:
    """The union of [start, end) intervals as disjoint sorted [start, end] pairs."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _gaps_ms(merged: list[list[float]], top: int = 12) -> tuple[float, list[list[float]]]:
    """(kernel span ms, the largest idle gaps between kernels as [start ms from the first kernel, ms])
    of `_merged` kernel intervals (us)."""
    if not merged:
        return 0.0, []
    t0 = merged[0][0]
    gaps = [[(a[1] - t0) / 1000, (b[0] - a[1]) / 1000] for a, b in zip(merged, merged[1:])]
    gaps = sorted(gaps, key=lambda g: -g[1])[:top]
    return (merged[-1][1] - t0) / 1000, [[round(a, 2), round(b, 3)] for a, b in gaps]


def _old_keep_logits(actor) -> None:
    actor.keep_logits_bytes = 0


def _old_addmm(actor) -> None:
    from furlong.trainer import logprobs

    def add_after(grad_w, gz, h):
        grad_w += gz.t() @ h
    logprobs._accumulate_weight_grad = add_after


# --old NAME -> what puts that lever back on the built actor, before its first (compiling) step;
# the module attributes are looked up at call time
OLD = {"keep_logits": _old_keep_logits, "addmm": _old_addmm}

# --host-only: the seed model's structure (28 layers, GQA 2:1, its vocabulary) with tiny layers
TINY_LAYERS = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 32}


def find_syncs(step) -> list[str]:
    """Distinct stacks (innermost frames) of the synchronizing CUDA calls one call of step makes."""
    sites: dict[str, int] = defaultdict(int)

    def note(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            sites["".join(traceback.format_stack(limit=12)[:-1])] += 1
    torch.cuda.set_sync_debug_mode("warn")
    old = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            step()
    finally:
        warnings.showwarning = old
        torch.cuda.set_sync_debug_mode(0)
    return [f"{n} time(s):\n{stack}" for stack, n in sorted(sites.items(), key=lambda kv: -kv[1])]


class HostLead:
    """Wraps the trainers' Trainer._finish to note (host seconds, CUDA event) when the host gets there."""

    def __init__(self):
        from furlong.trainer.base import Trainer
        inner = Trainer._finish
        self.marks: list[tuple[float, torch.cuda.Event]] = []

        def finish(trainer, *args, **kwargs):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((time.perf_counter(), ev))
            return inner(trainer, *args, **kwargs)
        Trainer._finish = finish

    def timed_step(self, fn) -> tuple[object, float, float, float]:
        """(fn's result, step s, host s to the optimizer step, GPU s to it) of one call of fn (one
        optimizer step)."""
        self.marks.clear()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        total = time.perf_counter() - t
        host_t, ev = self.marks[0]
        return out, total, host_t - t, start.elapsed_time(ev) / 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--label", default="baseline")
    ap.add_argument("--budget", type=int, default=32768)
    ap.add_argument("--workload", default=str(Path(__file__).with_name("seed_workload.json")),
                    help="bench workload whose step is profiled (e.g. bench/long_workload.json: 8k-token samples)")
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--reshard-after-forward", action="store_true",
                    help="FSDP's default: re-gather each layer in backward and per micro-batch")
    ap.add_argument("--host", action="store_true", help="also profile CPU ops; write the ops tables")
    ap.add_argument("--old", default="", help="comma-separated levers to turn back (module docstring)")
    ap.add_argument("--host-only", action="store_true", help="tiny layers: time the host's work alone")
    ap.add_argument("--find-syncs", action="store_true", help="list the step's host-device syncs")
    ap.add_argument("--skip-guard-eval", action="store_true",
                    help="after the warm-up, torch.compiler.set_stance(skip_guard_eval_unsafe=True): what "
                         "Dynamo's guard checks cost the host (an experiment: unsafe if inputs change kind)")
    a = ap.parse_args()
    olds = [x for x in a.old.split(",") if x]
    unknown = sorted(set(olds) - set(OLD))
    if unknown:
        ap.error(f"--old: unknown lever(s) {', '.join(unknown)} (choose from {', '.join(OLD)})")
    w = load_workload(a.workload)
    if a.host_only:
        w = dataclasses.replace(w, model={**w.model, **TINY_LAYERS})
    b = Bench(w)
    base_config = b.config

    def config(**kw):
        cfg = base_config(**{"gradient_checkpointing": a.recompute, **kw})
        cfg.parallel.fsdp_reshard_after_forward = a.reshard_after_forward
        return cfg
    b.config = config
    actor, samples, dev = b.actor(), b.train_samples(), b.device
    steps = dataclasses.replace(b.steps(), max_tokens_per_gpu=a.budget)
    for name in olds:
        OLD[name](actor)
    num_tokens = sum(s.num_tokens for s in samples)
    lead = HostLead()
    actor.train_step(samples, steps)                                       # warm-up: compiles
    if a.skip_guard_eval:
        torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    runs = []
    reset_peak(dev)
    for _ in range(3):
        runs.append(lead.timed_step(lambda: actor.train_step(samples, steps)))
    tm, times = runs[-1][0], [r[1] for r in runs]
    peak = peak_gib(dev)
    step_s = statistics.median(times)
    if a.find_syncs:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        syncs = find_syncs(lambda: actor.train_step(samples, steps))
        (Path(a.out) / f"profile_train_{a.label}_syncs.txt").write_text("\n\n".join(syncs) or "none\n")
        print(f"[profile_train] {len(syncs)} synchronizing call site(s)", flush=True)
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if a.host:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities, record_shapes=a.host, with_stack=a.host) as prof:
        torch.cuda.synchronize()
        t = time.perf_counter()
        actor.train_step(samples, steps)
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
    merged = _merged(intervals)
    busy_ms = sum(e - s for s, e in merged) / 1000
    span_ms, gaps = _gaps_ms(merged)
    res = {"label": a.label, "old": olds, "num_tokens": num_tokens, "budget": a.budget, "recompute": a.recompute,
           "reshard_after_forward": a.reshard_after_forward, "host_only": a.host_only,
           "skip_guard_eval": a.skip_guard_eval,
           "num_micro_batches": tm.num_micro_batches, "step_s_median3": step_s, "step_s_all": times,
           "host_s_all": [r[2] for r in runs], "gpu_s_all": [r[3] for r in runs],
           "tok_per_s": num_tokens / step_s, "peak_gib": peak, "profiled_wall_ms": prof_wall * 1000,
           "gpu_busy_ms": busy_ms, "gpu_idle_ms": prof_wall * 1000 - busy_ms,
           # idle before the first and after the last kernel (host work around the step's kernels)
           "gpu_idle_outside_kernels_ms": prof_wall * 1000 - span_ms, "largest_gaps_ms": gaps,
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
