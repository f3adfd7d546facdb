"""The fp8 KV cache: K and V stored as float8_e4m3fn with one fp32 scale per (token, KV head).

EngineConfig.kv_dtype "fp8_e4m3": every k and v row ([D] values of one token and one KV head) is
written as q = round_e4m3(x / s) with s = max|x| / 448 (e4m3's largest finite value), and read
back as q * s inside the decode attention (kernels.py, both the row and the cascade group
programs) and in the CPU references. Prefill and decode quantise alike (a prompt's own prefill
attention uses its unquantised k/v; every later read sees the fp8): the Triton store kernels
(store_kv, and decode_prologue in decode steps on CUDA) share one quantiser that agrees bit for bit
with `quantize` (IEEE division in both, rounding to nearest even).

Why per token and head: a decode step writes one token into a page, so a page-wide scale would
only be known once the page is full (or need re-quantizing the page as it fills); a scale fixed
at prefill (per layer and head) clips every later token larger than the prompt's; and scale 1
(no scaling) leaves small V rows in e4m3's subnormal range, where its 3 mantissa bits become 1
or 0. A per-row absmax scale has none of these failure modes, needs no calibration, is
computed from the row alone (sync-free, graph-safe), and puts each row's largest value at the
top of the e4m3 range, so every row keeps ~2^-4 relative precision.
Measured on CPU (tests/test_kv_fp8_scales.py, `pytest -s` prints it): a Qwen3-shaped model
(head_dim 128, weights at a trained model's scale, 6 of 128 K channels scaled up x4..x20 by the
k-norm, V scaled x0.1..x8 by layer), continuations the unquantised engine sampled, re-scored with
quantised K/V: mean |log-prob gap| to the unquantised model per token-head 0.197, fixed per
layer-head (from the prompt) 0.452, scale 1 0.347; bf16 K/V 0.022. A power-of-two scale (exact
division, tried first) measured 0.34-0.38 where max|x| / 448 measured 0.17-0.19 (two sequences
of a longer run of this model): with max|x| / 448 each row's largest element, the outlier
channel that dominates the scores, is stored exactly. On a model without
outliers (k-norm weights <= 4, V x0.5..x2) the three fp8 schemes were 0.0027, 0.0039, 0.0031.
The gap is the cost of e4m3's 3 mantissa bits (~2.6% rms relative error per element); the GPU
test (test_kv_fp8_gpu.py) reports the engine-vs-trainer gap with bf16 and fp8 KV side by side.
Bytes: a token-head is D bytes of data + 4 bytes of scale, against 2D in bf16: at D = 128, 132
against 256 (51.6%), so the same --rollout-kv-fraction holds 1.94x the tokens and a decode step
reads about half the bytes. The scales sit beside their data in the same page (page layout:
kv_cache.py), so a page is still the unit of allocation, forking and copying.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                 # largest finite e4m3fn value
MIN_SCALE = 1e-30               # an all-zero row keeps a finite scale (its values quantise to 0)
SCALE_BYTES = 4                 # fp32 scale per (token, KV head)
KV_DTYPES = ("auto", "bf16", "fp8_e4m3")   # EngineConfig.kv_dtype; auto and bf16: the model's dtype


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] float8_e4m3fn, scale [...] float32) with x ~= q * scale: scale =
    max(absmax / 448, MIN_SCALE), q = x / scale clamped to +-448 and rounded to nearest even (IEEE
    fp32 division, as store_kernels.store_kv)."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / FP8_MAX).clamp_min(MIN_SCALE)
    return (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., D] fp8, scale [...] -> [..., D] in dtype."""
    return (q.float() * scale[..., None]).to(dtype)


def kv_storage_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element dtype for EngineConfig.kv_dtype."""
    return FP8 if kv_dtype == "fp8_e4m3" else model_dtype
