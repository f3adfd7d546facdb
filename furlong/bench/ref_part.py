"""Bench part `ref`: the KL reference resident on the GPU against kept in CPU memory (--ref-placement).

For each placement, side by side in one call: an actor with `--use-kl-loss` is built as run set-up builds
it, and the part reports the GPU memory the actor and its reference hold between steps (what the trainer's
token budget has left), the reference log-prob pass's time (median of 3 after a warm-up: the offloaded
reference copies its weights to the GPU in each), the pass's peak, and what a step pays for the offload:
cpu's pass time minus gpu's. The budget is the workload's (no memory plan: the
pass is no-grad and needs far less than a training step).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from furlong.bench.measure import free_memory, peak_gib, reset_peak, timed
from furlong.bench.state import Bench

TIMED_PASSES = 3


@dataclass
class RefPlacementRow:
    placement: str                   # gpu | cpu
    resident_gib: float | None       # GPU memory held by the actor and its reference between steps (CUDA)
    pass_s: float                    # one reference log-prob pass over the step's samples (median)
    pass_s_all: list[float]          # [TIMED_PASSES]
    pass_peak_gib: float | None


@dataclass
class RefResult:
    rows: list[RefPlacementRow]      # gpu first, then cpu
    cpu_minus_gpu_s: float           # the offloaded reference's cost per step
    gib_saved: float | None          # resident GPU memory the offloaded reference frees (CUDA)


def _one(b: Bench, placement: str) -> RefPlacementRow:
    from furlong.config_map import actor_config, batching_config
    from furlong.trainer.actor import Actor
    cfg = b.trainer_placement(b.config())
    cfg.algo.use_kl_loss, cfg.ref.ref_placement = True, placement
    actor = Actor(b.random_model(), actor_config(cfg), b.ctx)
    dev = b.device
    free_memory(dev)
    resident = torch.cuda.memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    samples, steps = b.train_samples(), batching_config(cfg)
    actor.compute_log_probs(samples, steps, "ref")   # warm-up (compiles, pinned-memory first touch)
    reset_peak(dev)
    times = [timed(lambda: actor.compute_log_probs(samples, steps, "ref"), dev)[1] for _ in range(TIMED_PASSES)]
    row = RefPlacementRow(placement, resident, statistics.median(times), times, peak_gib(dev))
    print(f"[bench] ref {placement}: pass {row.pass_s:.3f}s, resident {resident} GiB, peak {row.pass_peak_gib} GiB",
          flush=True)
    del actor
    torch._dynamo.reset()   # compiled layers pin the modules they traced (state.Bench.release_actor)
    free_memory(dev)
    return row


def part_ref(b: Bench) -> RefResult:
    b.release_actor()   # this part builds its own actors, one at a time
    rows = [_one(b, p) for p in ("gpu", "cpu")]
    saved = None if rows[0].resident_gib is None else rows[0].resident_gib - rows[1].resident_gib
    return RefResult(rows, rows[1].pass_s - rows[0].pass_s, saved)
