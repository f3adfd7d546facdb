"""Reward shaping applied before advantages: DAPO's soft overlong penalty.

DAPO (Yu et al. 2025, "overlong reward shaping"): with max response length L and
a buffer of B tokens, a response of |y| tokens gets an extra reward
    0                                  if |y| <= L - B
    ((L - B) - |y|) / B * factor       if L - B < |y| <= L      (falls linearly to -factor)
    -factor                            if |y| > L               (cannot happen here: generation stops at L)
so responses approaching the limit are discouraged smoothly instead of by truncation alone.
"""
from __future__ import annotations


def overlong_penalty(num_tokens: int, max_len: int, buffer_len: int, factor: float) -> float:
    """The (non-positive) reward added to a response of `num_tokens` tokens."""
    start = max_len - buffer_len
    if num_tokens <= start:
        return 0.0
    return -factor * min(num_tokens - start, buffer_len) / buffer_len
