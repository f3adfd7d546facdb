"""Rotary position embedding (RoPE), "rotate-half" layout as in Llama/Qwen; linear, llama3 and YaRN rescaling.

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
  yarn    YaRN (Peng et al. 2023, "NTK-by-parts" + attention temperature): frequency pair i
          (of D/2) turns C * f_i / (2 pi) times over the original context C. Pairs turning more
          than beta_fast (32) times are kept, fewer than beta_slow (1) divided by `factor`; the
          ramp between is linear in the pair index i, from the index where beta_fast turns fit,
          i = D ln(C / (2 pi beta)) / (2 ln theta), floored, to the beta_slow one, ceiled
          (`truncate`, as transformers; exact bounds without it). cos and sin are multiplied by the
          attention factor, 0.1 ln(factor) + 1 unless the config gives `attention_factor` (the
          paper's sqrt(1/t)), which scales q.k by its square.
Only YaRN changes the attention scale. Dynamic NTK (which depends on the sequence length) is not
implemented; hf_config.py rejects it by name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency rescaling (module docstring)."""
    rope_type: str                       # a key of SCALINGS
    factor: float
    low_freq_factor: float = 1.0         # llama3
    high_freq_factor: float = 4.0        # llama3
    original_max_position_embeddings: int = 8192   # llama3, yarn: the context the model was trained on
    beta_fast: float = 32.0              # yarn: turns over the original context above which a pair is kept
    beta_slow: float = 1.0               # yarn: turns below which a pair is divided by `factor`
    attention_factor: float | None = None   # yarn: cos/sin multiplier (None: 0.1 ln(factor) + 1)
    truncate: bool = True                # yarn: ramp bounds floored/ceiled to whole pair indices


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The multiplier of cos and sin (1 but for YaRN)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0


def _linear(inv_freq: torch.Tensor, s: RopeScaling, theta: float) -> torch.Tensor:
    return inv_freq / s.factor


def _yarn(inv_freq: torch.Tensor, s: RopeScaling, theta: float) -> torch.Tensor:
    dim = 2 * inv_freq.shape[0]
    context = s.original_max_position_embeddings

    def pair_index(turns: float) -> float:     # i where pair i turns `turns` times over the context
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = pair_index(s.beta_fast), pair_index(s.beta_slow)
    if s.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi if hi != lo else hi + 0.001        # a zero-width ramp: a step at lo
    ramp = ((torch.arange(inv_freq.shape[0], device=inv_freq.device).float() - lo) / (hi - lo)).clamp(0, 1)
    # ramp 0 (fast pairs, i <= lo): kept; ramp 1 (slow pairs): divided by factor
    return inv_freq * (1 - ramp) + inv_freq / s.factor * ramp


def _llama3(inv_freq: torch.Tensor, s: RopeScaling, theta: float) -> torch.Tensor:
    context = s.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    smooth = ((context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
    # smooth is 0 past C / low_freq_factor (long waves: divided by factor), 1 below C / high_freq_factor
    return (1 - smooth) * inv_freq / s.factor + smooth * inv_freq


# rope_type -> inverse-frequency rescaling (the one place scalings are chosen)
SCALINGS: dict[str, Callable[[torch.Tensor, RopeScaling, float], torch.Tensor]] = {
    "linear": _linear, "llama3": _llama3, "yarn": _yarn}
# rope_type -> the RopeScaling fields it reads (config.json carries these; None ones are left out)
SCALING_FIELDS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "beta_fast", "beta_slow", "truncate", "original_max_position_embeddings", "attention_factor")}


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None,
                  scaling: RopeScaling | None = None) -> torch.Tensor:
    """[head_dim/2] fp32 inverse frequencies theta^(-2i/head_dim), rescaled by `scaling` if given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    return inv_freq if scaling is None else SCALINGS[scaling.rope_type](inv_freq, scaling, theta)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [..., T] -> (cos, sin), each [..., T, head_dim] fp32, times `attention_factor`
    (rope_attention_factor: YaRN's temperature)."""
    angles = position_ids.float().unsqueeze(-1) * inv_freq.float()   # [..., T, D/2]
    angles = torch.cat((angles, angles), dim=-1)                      # [..., T, D]
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos/sin [B, T, D] fp32. Returns x rotated, in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    out = xf * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)
    return out.to(x.dtype)
