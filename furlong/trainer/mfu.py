"""Model FLOPs utilisation, with the peak rate of the GPU in use.

FLOPs per trained token (attention ignored): 2 per weight in the forward, 2 per weight for the backward's
input gradients, and 2 per *trained* weight for the weight gradients: 6 x params for full-parameter
training, about 4 x params under LoRA (the frozen base gets no weight gradients, which the usual 6N
convention would count, overstating a LoRA run's MFU by ~1.5x). Over the peak dense bf16 rate of the
GPUs in use; recompute's extra forward is not counted (the usual convention: MFU counts useful work).

The peak comes from the device itself: a table of datasheet dense bf16 rates by device name, or,
for a GPU the table does not know, a short measurement (the best of a few 8192^3 bf16 matmuls;
a measured rate sits below the datasheet's, so MFU reads higher against it).
"""
from __future__ import annotations

import functools
import time

import torch

# Dense (no sparsity) bf16 tensor-core FLOP/s, vendor datasheets; matched by substring, first hit wins
# (so longer names that contain shorter ones come first: GB200 before B200).
PEAK_BF16_FLOPS = (
    ("GH200", 989e12), ("H200", 989e12), ("H100", 989e12), ("H800", 989e12), ("H20", 148e12),
    ("GB200", 2500e12), ("B200", 2250e12), ("B100", 1750e12),
    ("A100", 312e12), ("A800", 312e12), ("A10G", 70e12), ("A10", 125e12), ("L40S", 362e12), ("L40", 181e12),
    ("L4", 121e12), ("RTX 4090", 165e12), ("RTX 3090", 71e12), ("MI300X", 1307e12), ("MI250", 362e12),
)


def _measure(device: torch.device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for i in range(6):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        a @ b
        torch.cuda.synchronize(device)
        if i >= 2:       # the first runs load the kernel and raise the clocks
            best = min(best, time.perf_counter() - t)
    return 2 * 8192**3 / best


@functools.lru_cache(maxsize=None)
def peak_bf16_flops(device_name: str, device: torch.device | None = None) -> tuple[float, str]:
    """(peak FLOP/s of one device, where it came from: 'datasheet' | 'measured')."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops, "datasheet"
    if device is None or device.type != "cuda":
        return 0.0, "unknown"
    return _measure(device), "measured"


def train_flops_per_token(num_params: int, num_trainable_params: int) -> int:
    """Forward and backward FLOPs per token (module docstring); num_params counts every weight a token
    goes through (a LoRA run's base and adapters), num_trainable_params those that get gradients."""
    return 4 * num_params + 2 * num_trainable_params


def model_flops_per_token(model: torch.nn.Module) -> int:
    """train_flops_per_token of a trainer's model (sharded or not: a DTensor's numel is the whole tensor's)."""
    params = list(model.parameters())
    return train_flops_per_token(sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))


def mfu(flops_per_token: int, num_tokens: int, seconds: float, device: torch.device, world_size: int) -> float:
    """Training MFU over all ranks (0.0 off CUDA or when the time is 0)."""
    if device.type != "cuda" or seconds <= 0:
        return 0.0
    peak, _ = peak_bf16_flops(torch.cuda.get_device_name(device), device)
    return flops_per_token * num_tokens / seconds / (peak * world_size) if peak > 0 else 0.0
