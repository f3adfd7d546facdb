"""Evaluation on a fixed prompt set (docs/design.md §6): `eval/<name>` = mean reward.

Every prompt gets `n_samples` responses (one engine request of n samples).
Data-parallel: rank r generates and rewards the r-th contiguous share of the
prompts, then all ranks gather the samples, so each rank returns the same full
result. Request seeds derive from (params.seed, prompt index): the samples do
not depend on the number of ranks. params.seed None means a fresh seed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from furlong.engine.sampling import SamplingParams
from furlong.engine.sequence import Request
from furlong.rollout.in_flight import to_group
from furlong.rollout.rollout import derive_seed, gather_lists, rank_share, reward_groups
from furlong.types import DistContext, Prompt, Sample

if TYPE_CHECKING:
    from furlong.engine import Engine
    from furlong.eval_set_map import EvalSetConfig


@dataclass(frozen=True)
class EvalConfig:
    sampling: SamplingParams         # eval settings, each falling back to the rollout's; seed --rollout-seed
    n_samples_per_prompt: int        # --n-samples-per-eval-prompt
    interval: int | None             # --eval-interval: after every K-th rollout (None: never during training)
    before_train: bool               # also before the first rollout (not --skip-eval-before-train)


@dataclass
class EvalSet:
    """One eval set of a run: its settings (eval_set_map.py), prompts and reward function."""
    config: EvalSetConfig
    prompts: list[Prompt]
    reward_fn: Callable[[Sample], Any]   # --eval-reward-key, or the set's own rm_type

    @property
    def name(self) -> str:
        return self.config.name


@dataclass
class EvalResult:
    name: str                 # eval set name (metric eval/<name>)
    score: float              # mean reward over all samples
    num_samples: int          # len(prompts) * n_samples
    samples: list[Sample]     # ordered by prompt, then sample index; group_id = prompt index


def run_eval(name: str, prompts: list[Prompt], engine: Engine, reward_fn: Callable[[Sample], Any],
             params: SamplingParams, n_samples: int, ranks: DistContext | None,
             max_context_len: int | None = None) -> EvalResult:
    """`max_context_len`: prompt + response tokens of a sample (--eval-max-context-len; None: no cap)."""
    if not prompts:
        raise ValueError(f"--eval-prompt-data: eval set {name!r} has no prompts")
    base = params.seed if params.seed is not None else random.getrandbits(63)
    mine = rank_share(len(prompts), ranks)
    ids = list(range(mine.start, mine.stop))
    requests = [Request(request_id=engine.new_request_id(), prompt_ids=prompts[i].token_ids, params=params,
                        n=n_samples, seed=derive_seed(base, i),
                        sample_max_new_tokens=_context_cap(max_context_len, len(prompts[i].token_ids), params,
                                                           n_samples)) for i in ids]
    outs = engine.generate(requests)
    groups = [to_group(prompts[i], i, comps) for i, comps in zip(ids, outs)]
    reward_groups(groups, reward_fn)
    groups = gather_lists(groups, ranks)
    samples = [s for g in groups for s in g.samples]
    return EvalResult(name=name, score=sum(s.reward for s in samples) / len(samples),
                      num_samples=len(samples), samples=samples)


def _context_cap(max_context_len: int | None, num_prompt_tokens: int, params: SamplingParams, n: int) -> list[int] | None:
    if max_context_len is None or max_context_len - num_prompt_tokens >= params.max_new_tokens:
        return None
    return [max_context_len - num_prompt_tokens] * n
