"""Evaluation on a fixed prompt set (DESIGN.md §6): `eval/<name>` = mean reward.

Every prompt gets `n_samples` responses. Data-parallel: rank r generates and
rewards the r-th contiguous share of the prompts, then all ranks gather the
samples, so each rank returns the same full result. Each rank samples with a
seed derived from (params.seed, rank); params.seed None means unseeded.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from furlong.rollout.rollout import RankInfo, derive_seed, gather_lists, generate_groups, rank_share
from furlong.rollout.sampling import SamplingParams
from furlong.types import Prompt, Sample


@dataclass
class EvalResult:
    name: str                 # eval set name (metric eval/<name>)
    score: float              # mean reward over all samples
    num_samples: int          # len(prompts) * n_samples
    samples: list[Sample]     # ordered by prompt, then sample index; group_id = prompt index


def run_eval(name: str, prompts: list[Prompt], generator: Any, reward_fn: Callable[[Sample], Any],
             params: SamplingParams, n_samples: int, dist: RankInfo | None) -> EvalResult:
    if n_samples < 1:
        raise ValueError(f"--n-samples-per-eval-prompt: must be >= 1, got {n_samples}")
    if not prompts:
        raise ValueError(f"--eval-prompt-data: eval set {name!r} has no prompts")
    if params.seed is not None and dist is not None and dist.world_size > 1:
        params = dataclasses.replace(params, seed=derive_seed(params.seed, dist.rank))
    mine = rank_share(len(prompts), dist)
    groups = generate_groups(prompts[mine], mine.start, n_samples, generator, reward_fn, params)
    groups = gather_lists(groups, dist)
    samples = [s for g in groups for s in g.samples]
    return EvalResult(name=name, score=sum(s.reward for s in samples) / len(samples),
                      num_samples=len(samples), samples=samples)
