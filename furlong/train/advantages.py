"""Advantage estimators (DESIGN.md §5), picked by name from ADVANTAGE_FNS.

GRPO (miles semantics): within each group of n responses to one prompt,
`a = r - mean(r)`, then divided by `std(r, unbiased) + 1e-6` unless std
normalization is disabled (`--disable-grpo-std-normalization`). A group of one
sample or with zero std is only mean-subtracted (its advantages are then 0, or
exactly what miles' division by 1e-6 would give for the zero-std case: 0).
Each response token later receives its sample's advantage.
"""
from __future__ import annotations

from typing import Callable

import torch

# Added to the std so near-constant groups do not blow up (same constant as miles).
GRPO_STD_EPS = 1e-6


def grpo_advantages(rewards: torch.Tensor, normalize_std: bool = True) -> torch.Tensor:
    """GRPO advantages for rewards [G, n] (G groups of n samples); returns [G, n]."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected a [groups, samples] tensor, got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std or rewards.shape[1] < 2:
        return centered
    std = rewards.std(dim=1, unbiased=True, keepdim=True)
    # Zero-std groups keep the plain centered value (all zeros) instead of a division.
    scale = torch.where(std > 0, std + GRPO_STD_EPS, torch.ones_like(std))
    return centered / scale


AdvantageFn = Callable[[torch.Tensor, bool], torch.Tensor]

ADVANTAGE_FNS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
}


def get_advantage_fn(name: str) -> AdvantageFn:
    """The estimator registered under `name` (the --advantage-estimator value)."""
    try:
        return ADVANTAGE_FNS[name]
    except KeyError:
        raise ValueError(f"--advantage-estimator: unknown estimator {name!r} "
                         f"({', '.join(sorted(ADVANTAGE_FNS))})") from None
