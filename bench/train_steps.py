"""A few actor train steps of a workload, each timed as it ends (device): for shapes whose `furlong bench`
train part (two log-prob passes, a warm-up and three timed steps) does not fit a device call.

The bench's actor as `furlong bench` builds it (random weights of the workload's model, its samples, the
memory plan of run set-up), then --steps train steps; each prints its seconds, tokens per second and peak
memory as soon as it ends, so a call cut short still shows what ran. The first step includes compiling.

    python3 bench/train_steps.py --workload bench/qwen3_8b_workload.json --optimizer-cpu-offload [--steps 2]
                                 [--kv-cache-only] [--fsdp-cpu-offload] [--fsdp-reshard-after-forward]
"""
from __future__ import annotations

import argparse
import time

import torch

from furlong.bench.measure import peak_gib, reset_peak
from furlong.bench.state import Bench
from furlong.bench.workload import load_workload
from furlong.trainer.memory_plan import MemoryPlanError


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--optimizer-cpu-offload", action="store_true")
    ap.add_argument("--fsdp-cpu-offload", action="store_true")
    ap.add_argument("--fsdp-reshard-after-forward", action="store_true")
    ap.add_argument("--kv-cache-only", action="store_true",
                    help="--offload-rollout-level kv_cache: the plan reserves the engine's weights")
    a = ap.parse_args()
    b = Bench(load_workload(a.workload), cpu_offload=a.fsdp_cpu_offload, optimizer_offload=a.optimizer_cpu_offload,
              reshard_after_forward=a.fsdp_reshard_after_forward, offload_weights=not a.kv_cache_only)
    t0 = time.perf_counter()
    actor = b.actor()                          # prints the memory plan
    samples, steps = b.train_samples(), b.steps()
    num_tokens = sum(s.num_tokens for s in samples)
    print(f"[train_steps] actor and plan in {time.perf_counter() - t0:.1f}s: {len(samples)} samples, {num_tokens} "
          f"tokens, micro-batches of <= {steps.max_tokens_per_gpu} tokens", flush=True)
    for i in range(a.steps):
        reset_peak(b.device)
        t = time.perf_counter()
        m = actor.train_step(samples, steps)
        if b.device.type == "cuda":
            torch.cuda.synchronize()           # the step's end, for its time
        s = time.perf_counter() - t
        opt = m.optimizer_step_seconds   # device time: None off CUDA
        print(f"[train_steps] step {i + 1}: {s:.2f}s, {num_tokens / s / 1e3:.1f}k tok/s, {m.num_micro_batches} "
              f"micro-batches, optimizer step {'-' if opt is None else f'{opt:.2f}s'}, peak "
              f"{peak_gib(b.device) or 0:.1f} GiB", flush=True)


if __name__ == "__main__":
    try:
        main()
    except MemoryPlanError as e:     # the plan's refusal is a result: one line, as `furlong train` prints it
        raise SystemExit(f"[train_steps] memory plan: {e}")
