"""Rotary position embedding (RoPE), "rotate-half" layout as in Llama/Qwen.

Frequencies, angles and the rotation itself are computed in fp32 and the result
is cast back to the input dtype. (transformers casts cos/sin to the model dtype
first and rotates in bf16; ours is slightly more precise, which matters only in
the last bf16 bit.)

Frequency rescalings (config.json's `rope_scaling` / `rope_parameters`), each a function of the
plain inverse frequencies, picked by name in `SCALINGS`:
  linear  every frequency divided by `factor` (positions stretched by it)
  llama3  Llama 3.1's: with the original context C (`original_max_position_embeddings`), a
          wavelength 2*pi/f above C / low_freq_factor is divided by `factor`, one below
          C / high_freq_factor is kept, and one in between interpolates between the two by
          s = (C / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
Neither changes the attention scale. Length-dependent scalings (dynamic NTK, YaRN's attention
factor) are not implemented; hf_config.py rejects them by name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency rescaling (module docstring); fields other than `factor` are llama3's."""
    rope_type: str                       # a key of SCALINGS
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def _linear(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    return inv_freq / s.factor


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    context = s.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    smooth = ((context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
    # smooth is 0 past C / low_freq_factor (long waves: divided by factor), 1 below C / high_freq_factor
    return (1 - smooth) * inv_freq / s.factor + smooth * inv_freq


# rope_type -> inverse-frequency rescaling (the one place scalings are chosen)
SCALINGS: dict[str, Callable[[torch.Tensor, RopeScaling], torch.Tensor]] = {"linear": _linear, "llama3": _llama3}


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None,
                  scaling: RopeScaling | None = None) -> torch.Tensor:
    """[head_dim/2] fp32 inverse frequencies theta^(-2i/head_dim), rescaled by `scaling` if given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    return inv_freq if scaling is None else SCALINGS[scaling.rope_type](inv_freq, scaling)


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
