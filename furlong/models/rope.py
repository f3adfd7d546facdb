"""Rotary position embedding (RoPE), "rotate-half" layout as in Llama/Qwen.

Frequencies, angles and the rotation itself are computed in fp32 and the result
is cast back to the input dtype. (transformers casts cos/sin to the model dtype
first and rotates in bf16; ours is slightly more precise, which matters only in
the last bf16 bit.)
"""
from __future__ import annotations

import torch


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """[head_dim/2] fp32 inverse frequencies theta^(-2i/head_dim)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exponents)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [..., T] -> (cos, sin), each [..., T, head_dim] fp32."""
    angles = position_ids.float().unsqueeze(-1) * inv_freq.float()   # [..., T, D/2]
    angles = torch.cat((angles, angles), dim=-1)                      # [..., T, D]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos/sin [B, T, D] fp32. Returns x rotated, in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    out = xf * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)
    return out.to(x.dtype)
