"""--gradient-checkpointing on the GPU (device): the seed step with recompute, tok/s and memory.

The seed step trained with recompute and compiled layers at 32768 and at 200000 tokens per micro-batch; tok/s and peak memory of each.

    python3 bench/recompute_gpu.py [--budgets 32768,200000] [--out DIR]
The same step without recompute at 32768 is the bench's `train` part (BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from furlong.bench.measure import peak_gib, rate, reset_peak, timed
from furlong.bench.state import Bench
from furlong.bench.workload import load_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="32768,200000")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    b = Bench(load_workload(Path(__file__).with_name("seed_workload.json")))
    b.config = (lambda orig: lambda **kw: orig(**{"gradient_checkpointing": True, **kw}))(b.config)
    actor, samples = b.actor(), b.train_samples()
    assert actor.model.gradient_checkpointing
    num_tokens = sum(s.num_tokens for s in samples)
    rows = []
    for budget in [int(x) for x in a.budgets.split(",")]:
        steps = dataclasses.replace(b.steps(), max_tokens_per_gpu=budget)
        actor.train_step(samples, steps)                             # warm-up (compiles at the first size)
        reset_peak(b.device)
        tm, secs = timed(lambda: actor.train_step(samples, steps), b.device)
        rows.append({"max_tokens_per_gpu": budget, "num_micro_batches": tm.num_micro_batches, "seconds": secs,
                     "tok_per_s": rate(num_tokens, secs), "peak_gib": peak_gib(b.device), "loss": tm.loss})
        print(json.dumps(rows[-1]), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "recompute.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
