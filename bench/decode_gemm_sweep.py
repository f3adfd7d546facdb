"""The decode step's matmuls alone: each projection of a Qwen3 layer and the LM head at decode batch sizes
(device).

A decode step multiplies B rows (one token per running sequence) by every weight once: at B <= 256 these
are skinny GEMMs whose weights are read once per step. The profile of a graphed step (profile_decode.py)
puts ~0.9 ms of a 3.5 ms B=256 step in matmuls for 0.3 TFLOP and 1.19 GB of weights: this script says
which shapes fall short of their floor, max(weight bytes / bandwidth, FLOPs / peak), and by how much.
Each shape is timed over CUDA-graph replays of 28 copies of the weight (a layer's matmul in a model's
step reads a weight not in L2), median of 5 x 20 replays, as one or more implementations (--impl):
    cublas     F.linear, what the engine runs
    cublaslt   F.linear with torch's preferred BLAS library set to cuBLASLt
    autotune   F.linear compiled by inductor in max-autotune mode for this one shape (static M): the
               fastest of its Triton matmul templates and cuBLAS, benchmarked at compile time (tens of
               seconds per shape); an experiment, asking whether a different kernel beats cuBLAS here
    autotune-dynamic  the same compiled once per weight shape with a dynamic M, tuned at the first batch
               of --batch (list the largest first), then run at every batch: how the engine's compiled
               functions (dynamic token counts) would use it
    splitk     bench/skinny_linear.py's split-K Triton kernel (deterministic fix-up, no memset), the fastest
               of its candidate configs for each shape and batch (the config is printed): whether a kernel
               that spreads a skinny GEMM's weight over every multiprocessor beats cuBLAS here

    python3 bench/decode_gemm_sweep.py [--batch 16,64,128,256] [--model qwen3-0.6b|qwen3-4b|qwen3-8b]
        [--impl cublas,cublaslt,autotune,splitk] [--shapes qkv,o,...] [--bandwidth-tbs 3.35] [--peak-tflops 790]
        [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

# (hidden, intermediate, query heads, KV heads, head_dim, vocab, layers) of the published configs
MODELS = {"qwen3-0.6b": (1024, 3072, 16, 8, 128, 151936, 28), "qwen3-4b": (2560, 9728, 32, 8, 128, 151936, 36),
          "qwen3-8b": (4096, 12288, 32, 8, 128, 151936, 36)}
COPIES = 28     # distinct weights per shape, cycled, so each replay reads from HBM as a model's layers do


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """name -> (in features K, out features N) of the engine's fused projections (forward.py)."""
    h, inter, hq, hkv, d, vocab, _ = MODELS[model]
    return {"qkv": (h, (hq + 2 * hkv) * d), "o": (hq * d, h), "gate_up": (h, 2 * inter), "down": (inter, h),
            "lm_head": (h, vocab)}


def _static_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _dynamic_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:   # its own code object: its own cache
    return F.linear(x, w)


def linear_impl(name: str):
    """(x [M, K], w [N, K]) -> [M, N] as implementation `name` (module docstring)."""
    if name in ("cublas", "cublaslt"):
        return F.linear
    if name == "autotune":
        return torch.compile(_static_linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    if name == "autotune-dynamic":
        return torch.compile(_dynamic_linear, mode="max-autotune-no-cudagraphs", dynamic=True)
    raise ValueError(f"--impl: unknown implementation {name!r} (cublas, cublaslt, autotune, autotune-dynamic)")


def best_splitk(x: torch.Tensor, weights: list[torch.Tensor]) -> tuple[float, object]:
    """(ms, SkinnyLinear) of the fastest candidate config (skinny_linear.candidate_configs) at this shape."""
    from skinny_linear import SkinnyLinear, candidate_configs
    n, k = weights[0].shape
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    timed = [(time_linear(x, weights, lin), lin) for lin in map(SkinnyLinear, candidate_configs(len(x), k, n, sms))]
    return min(timed, key=lambda t: t[0])


def time_linear(x: torch.Tensor, weights: list[torch.Tensor], fn=F.linear) -> float:
    """ms per fn(x, w), the weights cycled inside one captured graph."""
    outs = [fn(x, w) for w in weights]                # warm-up: cuBLAS picks its kernel, inductor compiles
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [fn(x, w) for w in weights]
    torch.cuda.synchronize()
    del outs
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 20 / len(weights))
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="16,64,128,256", help="decode rows (comma list)")
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    ap.add_argument("--bandwidth-tbs", type=float, default=None,
                    help="the card's HBM peak, TB/s (default by name: H200 4.8, else the H100's 3.35)")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 dense matmul peak, TFLOP/s")
    ap.add_argument("--impl", default="cublas", help="implementations to time (comma list; module docstring)")
    ap.add_argument("--shapes", default="", help="projections to time (comma list; default all)")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    dev = torch.device("cuda")
    a.bandwidth_tbs = a.bandwidth_tbs or (4.8 if "H200" in torch.cuda.get_device_name() else 3.35)
    torch.manual_seed(0)
    impls = a.impl.split(",")
    # each compiled variant's graphs share one code object, so Dynamo's per-code cache must hold them all
    # (past its limit it would run the rest eagerly: cuBLAS, silently)
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 1024
    wanted = shapes(a.model) if not a.shapes else {k: shapes(a.model)[k] for k in a.shapes.split(",")}
    rows = []
    for name, (k, n) in wanted.items():
        copies = 2 if name == "lm_head" else COPIES    # the head is one weight (311 MB at 0.6B: past L2 anyway)
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        # "autotune" compiles per batch; "splitk" picks its config per batch (best_splitk)
        per_shape = {i: linear_impl(i) for i in impls if i not in ("autotune", "splitk")}
        for b in (int(x) for x in a.batch.split(",")):
            fns = {**per_shape, **({"autotune": linear_impl("autotune")} if "autotune" in impls else {})}
            x = torch.randn(b, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, weights[0]).float()
            for impl in impls:
                torch.backends.cuda.preferred_blas_library("cublaslt" if impl == "cublaslt" else "cublas")
                note = ""
                if impl == "splitk":
                    ms, fn = best_splitk(x, weights)
                    note = f"  {fn.config}"
                else:
                    fn = fns[impl]
                    ms = time_linear(x, weights, fn)
                err = (fn(x, weights[0]).float() - ref).abs().max().item()
                floor_ms = max(2 * n * k / a.bandwidth_tbs / 1e9, 2 * b * n * k / a.peak_tflops / 1e9)
                rows.append({"shape": name, "impl": impl, "k": k, "n": n, "batch": b, "ms": ms,
                             "floor_ms": floor_ms, "max_abs_diff_vs_cublas": err,
                             "weight_tbs": 2 * n * k / ms / 1e9, "tflops": 2 * b * n * k / ms / 1e9,
                             "config": note.strip()})
                print(f"{name:8s} {impl:9s} K={k:5d} N={n:6d} B={b:4d}  {ms * 1000:8.2f} us  floor "
                      f"{floor_ms * 1000:7.2f} us ({floor_ms / ms:5.1%})  weights {rows[-1]['weight_tbs']:.2f} "
                      f"TB/s  |diff| {err:.2g}{note}", flush=True)
            torch.backends.cuda.preferred_blas_library("cublas")
        del weights
    layers = MODELS[a.model][-1]
    for impl in impls:
        for b in (int(x) for x in a.batch.split(",")):
            mine = [r for r in rows if r["batch"] == b and r["impl"] == impl]
            step = sum(r["ms"] * (1 if r["shape"] == "lm_head" else layers) for r in mine)
            floor = sum(r["floor_ms"] * (1 if r["shape"] == "lm_head" else layers) for r in mine)
            print(f"{impl:9s} B={b:4d}: the timed shapes' matmuls a step {step:.3f} ms against a floor of "
                  f"{floor:.3f} ms ({floor / step:.0%})")
    out = Path(a.out) / "decode_gemm_sweep.json"
    out.write_text(json.dumps({"model": a.model, "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
