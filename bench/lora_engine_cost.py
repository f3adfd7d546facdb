"""LoRA in the engine: adapters merged into its weights at each sync, or applied in its forward? (device)

Issue 20 asks to measure which is faster. furlong merges (weight_sync sends W + s*B*A into the engine's
copy: one cost per rollout, 0.127 s at the Qwen3-8B shape on an H200). Applying them in the forward
instead adds, to every projection of every decode step, x @ A^T then @ B^T; this script times exactly
that difference on the projections of a decode step, with nothing else in the way: the engine's fused
matmuls (qkv, o, gate|up, down) of all layers for B rows, CUDA-graphed, with and without the adapter
matmuls (A and B fused per projection as the engine would fuse them: A of q/k/v stacked [3r, H], B
block-diagonal as one [out, 3r] matmul), rank r, bf16. Attention, norms and sampling are the same in
both and left out, so the figure is the forward-applied cost per decode step, which times the decode
steps of a rollout gives its cost per rollout against the merge's per sync.

    python3 bench/lora_engine_cost.py --workload bench/qwen3_8b_workload.json [--batch 256] [--rank 64]
        [--decode-steps 1024] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from furlong.bench.workload import load_workload


def _graph_ms(fn, reps: int = 20) -> float:
    """Median ms of one replay of `fn` captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="bench/qwen3_8b_workload.json")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=1024, help="decode steps of one rollout (its max length)")
    ap.add_argument("--merge-s", type=float, default=0.127, help="measured merge cost per sync (BENCHMARKS.md)")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    m = load_workload(a.workload).model
    hidden, inter, layers = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
    d = m.get("head_dim", hidden // m["num_attention_heads"])
    q_out, kv_out = m["num_attention_heads"] * d, m["num_key_value_heads"] * d
    dev, dt, r = torch.device("cuda"), torch.bfloat16, a.rank
    # per layer: (in, out, adapters fused into this matmul)
    shapes = [(hidden, q_out + 2 * kv_out, 3), (q_out, hidden, 1), (hidden, 2 * inter, 2), (inter, hidden, 1)]
    g = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=g) * 0.02   # noqa: E731
    weights = [[(rand(o, i), rand(k * r, i), rand(o, k * r)) for i, o, k in shapes] for _ in range(layers)]
    xs = {i: rand(a.batch, i) for i, _, _ in shapes}

    def plain():
        for layer in weights:
            for (w, _, _), (i, _, _) in zip(layer, shapes):
                torch.mm(xs[i], w.t())

    def applied():
        for layer in weights:
            for (w, aw, bw), (i, _, _) in zip(layer, shapes):
                torch.mm(xs[i], w.t()).add_(torch.mm(torch.mm(xs[i], aw.t()), bw.t()))

    plain_ms, applied_ms = _graph_ms(plain), _graph_ms(applied)
    extra_s = (applied_ms - plain_ms) / 1e3 * a.decode_steps
    res = {"workload": a.workload, "batch": a.batch, "rank": r, "layers": layers,
           "projections_ms_merged": plain_ms, "projections_ms_applied": applied_ms,
           "applied_extra_ms_per_step": applied_ms - plain_ms, "decode_steps": a.decode_steps,
           "applied_extra_s_per_rollout": extra_s, "merge_s_per_sync": a.merge_s,
           "faster": "merged" if extra_s > a.merge_s else "applied in the forward"}
    print(json.dumps(res, indent=1))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_engine_cost.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
