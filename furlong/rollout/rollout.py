"""One rollout: prompt groups -> responses -> rewards -> dynamic filter (DESIGN.md §2 steps 1-2, §6).

Over-sampling: each round draws `over_sampling_batch_size` prompts, generates
`n_samples_per_prompt` responses per prompt (one Group per prompt), rewards
them and runs the filter over the groups in draw order. Passing groups are kept
until `rollout_batch_size` are kept; passing groups beyond that are aborted
(counted, discarded); failing groups are dropped (counted per filter name).
Rounds repeat until enough groups are kept. Rounds run one after the other:
miles keeps requests in flight while filtering, the result is the same set of
rules applied round by round.

Bound: once the prompts drawn in this rollout reach max(len(dataset),
rollout_batch_size) — a full pass, or enough prompts that an unfiltered run
would be done — and still too few groups are kept, RolloutError is raised
rather than looping forever (typically every group got the same reward).

Data-parallel (`RankInfo`): every rank holds the same seeded dataset, so every
rank draws the same prompts. Rank r generates and rewards the r-th contiguous
share of each round's groups, then all ranks exchange finished groups with
all_gather_object; concatenated in rank order they are the round's groups in
draw order, so every rank filters identically and ends with the same kept list.
Sampling seed per (rollout seed, rollout_id, round, rank).
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from furlong.rewards.registry import compute_rewards
from furlong.rollout.filters import GroupFilter
from furlong.rollout.generator import Generation
from furlong.rollout.sampling import SamplingParams
from furlong.types import Group, Prompt, Sample

if TYPE_CHECKING:
    from furlong.config import Config


class RolloutError(RuntimeError):
    """The rollout cannot produce the groups it was asked for."""


@dataclass
class RankInfo:
    rank: int          # this process, 0..world_size-1
    world_size: int    # data-parallel ranks sharing the rollout


@dataclass
class RolloutSpec:
    rollout_batch_size: int          # groups kept per rollout
    n_samples_per_prompt: int        # samples per group
    over_sampling_batch_size: int    # prompts drawn per round
    sampling: SamplingParams         # its seed is ignored: each round derives its own
    seed: int                        # --rollout-seed

    @classmethod
    def from_config(cls, cfg: "Config") -> "RolloutSpec":
        return cls(rollout_batch_size=cfg.rollout.rollout_batch_size,
                   n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
                   over_sampling_batch_size=cfg.over_sampling_batch_size,
                   sampling=SamplingParams.for_rollout(cfg), seed=cfg.data.rollout_seed)


@dataclass
class RolloutMetrics:
    num_dropped: dict[str, int]      # groups failing the filter, by filter name
    num_aborted: int                 # passing groups beyond rollout_batch_size
    num_generated_groups: int        # groups generated over all rounds and ranks
    num_rounds: int
    raw_reward: float                # mean reward over kept samples
    response_len_mean: float         # tokens, kept samples
    response_len_max: int            # tokens, kept samples
    truncated_ratio: float           # kept samples that hit the max response length
    rollout_log_probs: float         # mean engine log-prob over kept response tokens
    num_tokens: int                  # prompt + response tokens of kept samples
    num_generated_tokens: int        # response tokens generated over all rounds and ranks
    seconds: float                   # wall clock of the whole rollout

    def as_log(self) -> dict[str, float]:
        """miles metric names (DESIGN.md §7)."""
        out = {
            "rollout/raw_reward": self.raw_reward,
            "rollout/response_len/mean": self.response_len_mean,
            "rollout/response_len/max": float(self.response_len_max),
            "rollout/truncated_ratio": self.truncated_ratio,
            "rollout/rollout_log_probs": self.rollout_log_probs,
            "rollout/num_generated_groups": float(self.num_generated_groups),
            "rollout/dynamic_filter/num_aborted": float(self.num_aborted),
            "perf/rollout_time": self.seconds,
            "perf/rollout_tok_per_s": self.num_generated_tokens / max(self.seconds, 1e-9),
        }
        for name, count in self.num_dropped.items():
            out[f"rollout/dynamic_filter/drop_{name}"] = float(count)
        return out


@dataclass
class RolloutBatch:
    groups: list[Group]              # kept groups, in draw order
    metrics: RolloutMetrics

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


def derive_seed(*parts: int) -> int:
    """A 63-bit seed mixing the parts (stable across processes and runs)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 1)


def rank_share(num: int, dist: RankInfo | None) -> slice:
    """The contiguous slice of `num` items this rank handles (first ranks take the remainder)."""
    if dist is None or dist.world_size == 1:
        return slice(0, num)
    base, extra = divmod(num, dist.world_size)
    start = dist.rank * base + min(dist.rank, extra)
    return slice(start, start + base + (1 if dist.rank < extra else 0))


def gather_lists(items: list[Any], dist: RankInfo | None) -> list[Any]:
    """Concatenation, in rank order, of every rank's `items` (identity on one rank)."""
    if dist is None or dist.world_size == 1:
        return items
    parts: list[Any] = [None] * dist.world_size
    torch.distributed.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def generate_groups(prompts: list[Prompt], first_group_id: int, n_samples: int, generator: Any,
                    reward_fn: Callable[[Sample], Any], params: SamplingParams) -> list[Group]:
    """n responses per prompt, rewarded; group ids count up from first_group_id."""
    if not prompts:
        return []
    gens: list[Generation] = generator.generate([p.token_ids for p in prompts for _ in range(n_samples)], params)
    groups = []
    for i, prompt in enumerate(prompts):
        samples = [Sample(prompt=prompt, group_id=first_group_id + i, index=j, response_ids=g.token_ids,
                          response_text=g.text, rollout_log_probs=g.log_probs, finish_reason=g.finish_reason)
                   for j, g in enumerate(gens[i * n_samples:(i + 1) * n_samples])]
        groups.append(Group(group_id=first_group_id + i, samples=samples))
    samples = [s for g in groups for s in g.samples]
    for s, r in zip(samples, compute_rewards(reward_fn, samples)):
        s.reward = r
    return groups


def generate_rollout(dataset: Any, generator: Any, reward_fn: Callable[[Sample], Any],
                     filter_fn: GroupFilter | None, rollout_cfg: RolloutSpec, dist: RankInfo | None,
                     rollout_id: int) -> RolloutBatch:
    """Generate, reward and filter until `rollout_batch_size` groups are kept (module docstring)."""
    started = time.perf_counter()
    target, per_round = rollout_cfg.rollout_batch_size, rollout_cfg.over_sampling_batch_size
    limit = max(len(dataset), target)
    kept: list[Group] = []
    dropped: Counter[str] = Counter()
    num_aborted = num_generated_groups = num_generated_tokens = consumed = rounds = 0
    rank = 0 if dist is None else dist.rank
    while len(kept) < target:
        if consumed >= limit:
            raise RolloutError(
                f"dynamic sampling filter kept {len(kept)}/{target} groups after a full pass over {consumed} "
                f"prompts (data set has {len(dataset)}); rewards may all be equal (e.g. all 0)")
        prompts = dataset.next_batch(per_round)
        params = dataclasses.replace(rollout_cfg.sampling,
                                     seed=derive_seed(rollout_cfg.seed, rollout_id, rounds, rank))
        mine = rank_share(len(prompts), dist)
        groups = generate_groups(prompts[mine], consumed + mine.start, rollout_cfg.n_samples_per_prompt,
                                 generator, reward_fn, params)
        groups = gather_lists(groups, dist)
        consumed += len(prompts)
        rounds += 1
        num_generated_groups += len(groups)
        num_generated_tokens += sum(len(s.response_ids) for g in groups for s in g.samples)
        for g in groups:
            if filter_fn is not None and not filter_fn(g):
                dropped[filter_fn.name] += 1
            elif len(kept) < target:
                kept.append(g)
            else:
                num_aborted += 1
    metrics = _summarize(kept, dict(dropped), num_aborted, num_generated_groups, rounds,
                         num_generated_tokens, time.perf_counter() - started)
    return RolloutBatch(groups=kept, metrics=metrics)


def _summarize(kept: list[Group], dropped: dict[str, int], num_aborted: int, num_generated_groups: int,
               num_rounds: int, num_generated_tokens: int, seconds: float) -> RolloutMetrics:
    samples = [s for g in kept for s in g.samples]
    lens = [len(s.response_ids) for s in samples]
    num = max(len(samples), 1)
    num_resp = sum(lens)
    return RolloutMetrics(
        num_dropped=dropped, num_aborted=num_aborted, num_generated_groups=num_generated_groups,
        num_rounds=num_rounds,
        raw_reward=sum(s.reward for s in samples) / num,
        response_len_mean=num_resp / num, response_len_max=max(lens, default=0),
        truncated_ratio=sum(s.truncated for s in samples) / num,
        rollout_log_probs=sum(sum(s.rollout_log_probs) for s in samples) / max(num_resp, 1),
        num_tokens=sum(s.num_tokens for s in samples), num_generated_tokens=num_generated_tokens,
        seconds=seconds)
