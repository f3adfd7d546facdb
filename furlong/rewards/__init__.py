"""Rewards: the math answer checker, the name registry and offline scoring.

Built-in `--rm-type`s: `math` (math_reward), `deepscaler` and `dapo` (the answer
rules of miles; deepscaler.py, dapo.py). Stable public API:
`score(rm_type, response, label) -> float`.
"""
from __future__ import annotations

from furlong.rewards.math_reward import extract_answer, math_score
from furlong.rewards.registry import SCORERS, compute_rewards, get_reward_fn, score

__all__ = ["score", "get_reward_fn", "compute_rewards", "math_score", "extract_answer", "SCORERS"]
