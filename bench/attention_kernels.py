"""Packed causal attention kernels side by side on one seed micro-batch (device).

The seed step's first micro-batch shape (its samples' lengths in order up to 32768 tokens; Qwen3-0.6B
heads: 16 query, 8 K/V, head dim 128), bf16. Forward and backward of:
  flash_gqa     aten._flash_attention_forward/_backward with 8 K/V heads (what furlong uses)
  flash_mha     the same with K/V expanded to 16 heads (plus the expansion and the gradient sum)
  cudnn_mha     aten._cudnn_attention_forward/_backward (cuDNN's fused attention), K/V expanded
  cudnn_gqa     the same with 8 K/V heads, if cuDNN takes them
Each: median ms over 20 calls (CUDA events), and its output's and gradients' largest difference from
flash_gqa's. A kernel this torch lacks, or that rejects the inputs, is reported with its error.

    python3 bench/attention_kernels.py [--out DIR]     -> DIR/attention_kernels.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from furlong.bench.measure import median_ms
from furlong.bench.workload import load_workload

HQ, HKV, D = 16, 8, 128


def _flash(q, k, v, cu, m, g):
    out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, m, m, 0.0, True, False,
                                                                        scale=D ** -0.5)
    if g is None:
        return out, None
    return out, torch.ops.aten._flash_attention_backward(g, q, k, v, out, lse, cu, cu, m, m, 0.0, True, seed, offset,
                                                         scale=D ** -0.5)


def _cudnn(q, k, v, cu, m, g):
    res = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, m, m, True, 0.0, True, False, scale=D ** -0.5)
    out, lse, seed, offset = res[0], res[1], res[6], res[7]
    if g is None:
        return out, None
    bwd = torch.ops.aten._cudnn_attention_backward
    try:   # attn_bias is a non-optional Tensor in the schema; autograd passes an undefined one
        return out, bwd(g, q, k, v, out, lse, seed, offset, None, cu, cu, m, m, 0.0, True, scale=D ** -0.5)
    except (TypeError, RuntimeError):
        return out, bwd(g, q, k, v, out, lse, seed, offset, torch.empty(0, device=q.device, dtype=q.dtype), cu, cu,
                        m, m, 0.0, True, scale=D ** -0.5)


def _expanded(fn):
    def run(q, k, v, cu, m, g):
        ke, ve = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
        out, grads = fn(q, ke, ve, cu, m, g)
        if grads is None:
            return out, None
        dq, dk, dv = grads
        return out, (dq, *(t.unflatten(1, (HKV, HQ // HKV)).sum(2) for t in (dk, dv)))
    return run


KERNELS = {"flash_gqa": _flash, "flash_mha": _expanded(_flash), "cudnn_mha": _expanded(_cudnn), "cudnn_gqa": _cudnn}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    lens = [p + r for p, r in load_workload(Path(__file__).with_name("seed_workload.json")).first_micro_batch(32768)]
    total = sum(lens)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    m = max(lens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(total, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    g = torch.randn(total, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    # causal attention FLOPs: 2 matmuls of 2*L*L*D per head, half the square
    flops = sum(2 * 2 * n * n * D * HQ / 2 for n in lens)
    res = {"num_tokens": total, "num_samples": len(lens), "max_seqlen": m, "fwd_tflop": flops / 1e12,
           "torch": torch.__version__, "kernels": {}}
    ref = _flash(q, k, v, cu, m, g)
    for name, fn in KERNELS.items():
        try:
            out, grads = fn(q, k, v, cu, m, g)
            diff = max((x.float() - y.float()).abs().max().item() for x, y in zip((out, *grads), (ref[0], *ref[1])))
            fwd = median_ms(lambda: fn(q, k, v, cu, m, None), q.device, 20)
            both = median_ms(lambda: fn(q, k, v, cu, m, g), q.device, 20)
            res["kernels"][name] = {"fwd_ms": fwd, "fwd_bwd_ms": both, "fwd_tflops": flops / fwd / 1e9,
                                    "max_abs_diff_vs_flash_gqa": diff}
        except Exception as e:   # a missing or refusing kernel is a result here
            res["kernels"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, res["kernels"][name], flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "attention_kernels.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
