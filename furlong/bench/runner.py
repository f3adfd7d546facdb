"""`run_bench`: run the selected parts in order, each guarded, and report (docs/design.md §9).

Each part runs in try/except under a time guard, so one call always ends with
a table and a JSON, rewritten after every part. Time: each part has a SIGALRM
guard (PART_GUARD_S on CUDA), and no part starts once FURLONG_BENCH_TIME_S
(default 480) is spent; skipped and timed-out parts are reported as such.
"""
from __future__ import annotations

import dataclasses
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from furlong.bench.generation_parts import part_decode, part_eval, part_rollout
from furlong.bench.measure import PartTimeout, free_memory, time_guard
from furlong.bench.ref_part import part_ref
from furlong.bench.report import PartReport, format_table, step_summary, write_json
from furlong.bench.rl_step_part import part_rlstep
from furlong.bench.state import Bench
from furlong.bench.train_parts import part_budget, part_hf, part_train
from furlong.bench.trl_part import part_trl
from furlong.bench.workload import load_workload, parse_parts

# Per-part wall-clock guards (s) on CUDA; the whole run also stops starting parts
# once FURLONG_BENCH_TIME_S (default 480 s: the device call allows 9 minutes) is spent.
# trl: 5 TRL steps of ~55 s each (HF generate at 256 rows runs ~2.8k tok/s: 256 x 458 tokens is
# ~45 s, plus ~8 s of HF fwd+bwd) after furlong's step and its compiles; a guard that fires after
# the warm-ups still leaves the timed steps done (see trl_part.py).
# rlstep: 2 x num_steps (3) real steps; the seed workload's take ~5 s each, the long one's ~80 s (raise the guard)
PART_GUARD_S = {"train": 150, "budget": 120, "hf": 90, "rollout": 150, "decode": 170, "eval": 150, "trl": 420,
                "rlstep": 240, "ref": 150}

# The part registry: name -> function of the run state returning that part's result dataclass.
PARTS: dict[str, Callable[[Bench], Any]] = {
    "train": part_train, "budget": part_budget, "hf": part_hf, "rollout": part_rollout, "decode": part_decode,
    "eval": part_eval, "trl": part_trl, "rlstep": part_rlstep, "ref": part_ref,
}


def _environment(b: Bench) -> dict[str, Any]:
    import platform

    import transformers
    from furlong.models.attention import select_packed_impl
    probe = torch.empty(1, 1, 1, dtype=b.dtype, device=b.device)
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(b.device) if b.device.type == "cuda" else "cpu",
            "world_size": b.ctx.world_size, "dtype": str(b.dtype), "packed_attention": select_packed_impl(probe)}


def run_bench(workload_path: str, output_path: str | None = None, parts: str = "all", kv_dtype: str = "auto",
              cpu_offload: bool = False, lora_rank: int = 0, lora_alpha: float = 16.0,
              optimizer_offload: bool = False, reshard_after_forward: bool = False,
              offload_weights: bool = False) -> int:
    """Run the selected parts; print a table; write JSON (output_path, else $OUT/bench.json).

    Returns 0 when every selected part finished, 1 otherwise (the JSON is written either way).
    """
    names = parse_parts(parts)
    w = load_workload(workload_path)
    out = Path(output_path) if output_path else (Path(os.environ["OUT"]) / "bench.json" if os.environ.get("OUT")
                                                 else None)
    b = Bench(w, kv_dtype=kv_dtype, cpu_offload=cpu_offload, lora_rank=lora_rank, lora_alpha=lora_alpha,
              optimizer_offload=optimizer_offload, reshard_after_forward=reshard_after_forward,
              offload_weights=offload_weights)
    total_s = float(os.environ.get("FURLONG_BENCH_TIME_S", "480"))
    t_start = time.perf_counter()
    payload: dict[str, Any] = {"workload": w.name, "workload_file": str(workload_path), "kv_dtype": kv_dtype,
                               "parts": {}}
    try:
        payload["environment"] = _environment(b)
        print(f"[bench] {w.name}: {w.num_samples} samples, {sum(w.sample_lengths())} tokens, parts {names}, "
              f"{payload['environment']}", flush=True)
        for name in names:
            rep = b.reports[name] = PartReport(name)
            left = total_s - (time.perf_counter() - t_start)
            # FURLONG_BENCH_GUARD_S raises every part's guard (long workloads: a 77 s rollout runs twice)
            part_s = float(os.environ.get("FURLONG_BENCH_GUARD_S", PART_GUARD_S[name]))
            guard = min(part_s, left - 5) if b.device.type == "cuda" else left - 5
            if guard < 15:
                rep.error = f"only {left:.0f}s left of the {total_s:.0f}s bench budget"
            else:
                print(f"[bench] part {name} (guard {guard:.0f}s)", flush=True)
                t = time.perf_counter()
                try:
                    with time_guard(guard):
                        rep.result = PARTS[name](b)
                    rep.status = "ok"
                except PartTimeout as e:
                    rep.status, rep.error = "timeout", str(e)
                except Exception as e:   # report and go on: one call must yield every part it can
                    rep.status, rep.error = "error", f"{type(e).__name__}: {e}".splitlines()[0][:500]
                    traceback.print_exc()
                rep.seconds = time.perf_counter() - t
                free_memory(b.device)
                print(f"[bench] part {name}: {rep.status} in {rep.seconds:.1f}s {rep.error}", flush=True)
            if name in ("train", "budget"):
                b.release_actor()   # HF and rollout need the memory; budget builds a fresh actor
            payload["parts"][name] = dataclasses.asdict(rep)
            write_json(out, payload)
        summary = step_summary(b.reports)
        payload["step"] = dataclasses.asdict(summary)
        payload["total_s"] = time.perf_counter() - t_start
        write_json(out, payload)
        print("\n" + format_table(b.reports, summary), flush=True)
        if out is not None:
            print(f"[bench] wrote {out}", flush=True)
    finally:
        if b.owns_group:
            from furlong.launch.distributed import destroy_distributed
            destroy_distributed()
    return 0 if all(r.status == "ok" for r in b.reports.values()) else 1
