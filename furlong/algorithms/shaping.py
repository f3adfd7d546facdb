"""Reward shaping applied before advantages: DAPO's soft overlong penalty.

DAPO (Yu et al. 2025, "overlong reward shaping"): with max response length L and
a buffer of B tokens, a response of |y| tokens gets an extra reward
    0                                  if |y| <= L - B
    ((L - B) - |y|) / B * factor       if L - B < |y| <= L      (falls linearly to -factor)
    -factor                            if |y| > L               (cannot happen here: generation stops at L)
so responses approaching the limit are discouraged smoothly instead of by truncation alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShapingConfig:
    overlong_buffer_len: int | None  # --overlong-buffer-len (None: no shaping)
    overlong_penalty_factor: float   # --overlong-penalty-factor
    max_response_len: int            # tokens (--rollout-max-response-len)


def overlong_penalty(num_tokens: int, max_len: int, buffer_len: int, factor: float) -> float:
    """The (non-positive) reward added to a response of `num_tokens` tokens."""
    start = max_len - buffer_len
    if num_tokens <= start:
        return 0.0
    return -factor * min(num_tokens - start, buffer_len) / buffer_len


def shaped_rewards(rewards: torch.Tensor, response_lens: list[list[int]], cfg: ShapingConfig) -> torch.Tensor:
    """rewards [G, n] (float32) plus the overlong penalty of each response's length (when configured)."""
    out = rewards.float().clone()
    if cfg.overlong_buffer_len is not None:
        for g, lens in enumerate(response_lens):
            for j, n in enumerate(lens):
                out[g, j] += overlong_penalty(n, cfg.max_response_len, cfg.overlong_buffer_len,
                                              cfg.overlong_penalty_factor)
    return out
