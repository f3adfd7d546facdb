"""--log-passrate and --log-reward-category: reward statistics of a rollout's or an eval set's samples.

pass@k (miles' metric_utils): for k = 1, 2, 4, ... up to the group size n, the unbiased estimate
1 - C(n - c, k) / C(n, k) per group (c = samples whose reward is exactly 1), averaged over complete
groups; none for n = 1. Rollout keys passrate/pass@k, eval keys eval/<name>-pass@k.
Reward category: the share of samples per value of the reward dict's `key` (kept by --reward-key in
sample.metadata["rewards"]); rollout keys rollout/error_cat/<value>, eval eval/<name>/error_cat/<value>.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from furlong.types import Sample


@dataclass(frozen=True)
class RewardLogConfig:
    log_passrate: bool = False
    category_key: str | None = None   # --log-reward-category


def pass_at_k(rewards: list[list[float]]) -> dict[str, float]:
    """{"pass@k": mean estimate} over groups of equal size n (rewards[g][i]); {} when n < 2."""
    n = len(rewards[0]) if rewards else 0
    if n < 2:
        return {}
    out = {}
    for k in (2 ** i for i in range(int(math.log2(n)) + 1)):
        est = [1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)
               for c in (sum(r == 1 for r in g) for g in rewards)]
        out[f"pass@{k}"] = sum(est) / len(est)
    return out


def category_shares(samples: list[Sample], key: str) -> dict[str, float]:
    """{value: share of samples} of the reward dict's `key` (ValueError naming the flag if absent)."""
    cats = []
    for s in samples:
        scores = s.metadata.get("rewards")
        if not isinstance(scores, dict) or key not in scores:
            raise ValueError(f"--log-reward-category: sample (group {s.group_id}, index {s.index}) has no reward "
                             f"dict with {key!r} (the reward function must return a dict; see --reward-key)")
        cats.append(str(scores[key]))
    return {c: num / len(samples) for c, num in Counter(cats).items()}


def _groups(samples: list[Sample], n: int) -> list[list[float]]:
    by: dict[int, list[float]] = {}
    for s in samples:
        by.setdefault(s.group_id, []).append(float(s.reward))
    return [g for g in by.values() if len(g) == n]   # complete groups only, as miles


def rollout_reward_logs(samples: list[Sample], n: int, cfg: RewardLogConfig) -> dict[str, float]:
    out: dict[str, float] = {}
    if cfg.log_passrate:
        out.update({f"passrate/{k}": v for k, v in pass_at_k(_groups(samples, n)).items()})
    if cfg.category_key is not None and samples:
        out.update({f"rollout/error_cat/{c}": v for c, v in category_shares(samples, cfg.category_key).items()})
    return out


def eval_reward_logs(name: str, samples: list[Sample], n: int, cfg: RewardLogConfig) -> dict[str, float]:
    out: dict[str, float] = {}
    if cfg.log_passrate:
        out.update({f"eval/{name}-{k}": v for k, v in pass_at_k(_groups(samples, n)).items()})
    if cfg.category_key is not None and samples:
        out.update({f"eval/{name}/error_cat/{c}": v for c, v in category_shares(samples, cfg.category_key).items()})
    return out
