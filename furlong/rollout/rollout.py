"""One rollout: prompt groups -> responses -> rewards -> dynamic filter (docs/design.md §2 steps 1-2, §6).

Streaming over-sampling, as miles does it: whenever the groups kept plus the
groups in flight fall short of `rollout_batch_size`, the next
`over_sampling_batch_size` prompts are drawn and submitted to the engine as one
request each (n samples, prefilled once). As soon as all n samples of a group
have finished, the group is rewarded and passed through the filter while
generation goes on: passing groups are kept, failing ones dropped (counted per
filter name). Once `rollout_batch_size` groups are kept, every request still in
flight is aborted; those groups count as `num_aborted`.

Bound: once the prompts drawn in this rollout reach max(len(dataset),
rollout_batch_size) and nothing is left in flight with too few groups kept,
RolloutError is raised rather than looping forever (typically every group got
the same reward).

Data-parallel (`DistContext`): every rank holds the same seeded dataset, so every
rank draws the same prompts; rank r submits the r-th contiguous share of each
batch to its own engine. After each engine step all ranks exchange the groups
that finished (all_gather_object, rank order), so every rank filters the same
groups in the same order, keeps the same list, and aborts at the same point.
Sampling seeds depend only on (rollout seed, rollout id, group id), so a group's
samples do not depend on the number of ranks.

Progress: rank 0 reports a line at least every `REPORT_EVERY_S` seconds while a rollout runs
(samples done, groups kept/dropped/in flight, generated tokens per second), so a rollout that
keeps dropping groups is never silent; `give_up_rule` states the bound above at start-up.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from furlong.engine.sampling import SamplingParams
from furlong.engine.sequence import Completion, Request
from furlong.rewards.registry import compute_rewards
from furlong.rollout.filters import GroupFilter
from furlong.types import DistContext, Group, Prompt, Sample

if TYPE_CHECKING:   # the engine is built by run set-up; tests pass stand-ins with the same methods
    from furlong.data import PromptDataset
    from furlong.engine import Engine


REPORT_EVERY_S = 10.0   # seconds between progress lines inside one rollout


def _print_line(text: str) -> None:
    print(text, flush=True)


def give_up_rule(spec: RolloutConfig, num_prompts: int, filter_name: str) -> str:
    """The bound of the module docstring, in words, for the run's start."""
    limit = max(num_prompts, spec.rollout_batch_size)
    return (f"dynamic sampling filter {filter_name}: each rollout keeps {spec.rollout_batch_size} groups of "
            f"{spec.n_samples_per_prompt}; it gives up with an error when {limit} prompts (max of the data set's "
            f"{num_prompts} and --rollout-batch-size) have been drawn and fewer groups passed")


class RolloutError(RuntimeError):
    """The rollout cannot produce the groups it was asked for."""


@dataclass(frozen=True)
class RolloutConfig:
    rollout_batch_size: int          # groups kept per rollout
    n_samples_per_prompt: int        # samples per group
    over_sampling_batch_size: int    # prompts drawn per submitted batch (--over-sampling-batch-size, default
                                     # --rollout-batch-size: config_map resolves it)
    sampling: SamplingParams         # its seed is ignored: each group derives its own
    seed: int                        # --rollout-seed
    max_context_len: int | None = None   # --rollout-max-context-len: prompt + response tokens of a sample


@dataclass
class RolloutMetrics:
    num_dropped: dict[str, int]      # groups failing the filter, by filter name
    num_aborted: int                 # groups still in flight when enough were kept
    num_generated_groups: int        # groups finished over all ranks (kept + dropped)
    raw_reward: float                # mean reward over kept samples
    response_len_mean: float         # tokens, kept samples
    response_len_max: int            # tokens, kept samples
    truncated_ratio: float           # kept samples that hit the max response length
    rollout_log_probs: float         # mean engine log-prob over kept response tokens
    num_generated_tokens: int        # response tokens generated over all ranks (aborted ones too)
    seconds: float                   # wall clock of the whole rollout
    reward_seconds: float            # of which in reward functions (this rank's groups)
    engine: dict[str, float] = field(default_factory=dict)   # this rank's engine counters (perf/*)
    trained_tokens_mean: float = 0.0     # loss-mask tokens per kept sample (model tokens; tool tokens excluded)
    turns_mean: float = 1.0              # model turns per kept sample
    num_failed_samples: int = 0          # custom generate failures dropped with their groups (on-error drop)
    custom: dict[str, float] = field(default_factory=dict)   # a --rollout-function-path's own metrics, by log name

    def as_log(self) -> dict[str, float]:
        """miles metric names (docs/design.md §7), plus the engine's perf counters."""
        out = {
            "rollout/raw_reward": self.raw_reward,
            "rollout/response_len/mean": self.response_len_mean,
            "rollout/response_len/max": float(self.response_len_max),
            "rollout/truncated_ratio": self.truncated_ratio,
            "rollout/rollout_log_probs": self.rollout_log_probs,
            "rollout/num_generated_groups": float(self.num_generated_groups),
            "rollout/dynamic_filter/num_aborted": float(self.num_aborted),
            "rollout/trained_tokens/mean": self.trained_tokens_mean,
            "rollout/turns/mean": self.turns_mean,
            "rollout/custom_generate/num_failed": float(self.num_failed_samples),
            "perf/rollout_time": self.seconds,
            "perf/rollout_tok_per_s": self.num_generated_tokens / max(self.seconds, 1e-9),
            "perf/reward_time": self.reward_seconds,
            **self.engine,
            **self.custom,
        }
        for name, count in self.num_dropped.items():
            out[f"rollout/dynamic_filter/drop_{name}"] = float(count)
        return out


@dataclass
class RolloutBatch:
    groups: list[Group]              # kept groups, in the order they passed the filter
    metrics: RolloutMetrics

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


def derive_seed(*parts: int) -> int:
    """A 63-bit seed mixing the parts (stable across processes and runs)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 1)


def rank_share(num: int, ranks: DistContext | None) -> slice:
    """The contiguous slice of `num` items this rank handles (first ranks take the remainder)."""
    if ranks is None or ranks.world_size == 1:
        return slice(0, num)
    base, extra = divmod(num, ranks.world_size)
    start = ranks.rank * base + min(ranks.rank, extra)
    return slice(start, start + base + (1 if ranks.rank < extra else 0))


def gather_lists(items: list[Any], ranks: DistContext | None) -> list[Any]:
    """Concatenation, in rank order, of every rank's `items` (identity on one rank)."""
    if ranks is None or ranks.world_size == 1:
        return items
    parts: list[Any] = [None] * ranks.world_size
    torch.distributed.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def to_group(prompt: Prompt, group_id: int, completions: list[Completion]) -> Group:
    samples = [Sample(prompt=prompt, group_id=group_id, index=c.index, response_ids=c.token_ids,
                      response_text=c.text, rollout_log_probs=c.log_probs, finish_reason=c.finish_reason,
                      metadata=dict(prompt.metadata))
               for c in sorted(completions, key=lambda c: c.index)]
    return Group(group_id=group_id, samples=samples)


def reward_groups(groups: list[Group], reward_fn: Callable[[Sample], Any]) -> None:
    """Rewards of the samples that have none yet (a custom generate function may have set some); a
    --group-rm reward (rewards/group_reward.py) takes each group's whole list."""
    if getattr(reward_fn, "per_group", False):
        for g in groups:
            todo = [s for s in g.samples if s.reward is None]
            for s, r in zip(todo, reward_fn.reward_group(todo) if todo else []):
                s.reward = r
        return
    samples = [s for g in groups for s in g.samples if s.reward is None]
    for s, r in zip(samples, compute_rewards(reward_fn, samples)):
        s.reward = r


class _Submitted:
    """This rank's requests in flight: request id -> (prompt, group id, finished completions)."""

    def __init__(self) -> None:
        self.requests: dict[int, tuple[Prompt, int, list[Completion]]] = {}

    def collect(self, done: list[Completion], n: int) -> list[Group]:
        groups = []
        for c in done:
            prompt, gid, comps = self.requests[c.request_id]
            comps.append(c)
            if len(comps) == n:
                del self.requests[c.request_id]
                groups.append(to_group(prompt, gid, comps))
        return groups


def generate_rollout(dataset: PromptDataset, engine: Engine, reward_fn: Callable[[Sample], Any],
                     filter_fn: GroupFilter | None, cfg: RolloutConfig, ranks: DistContext | None,
                     rollout_id: int, report: Callable[[str], None] | None = _print_line,
                     report_every_s: float = REPORT_EVERY_S) -> RolloutBatch:
    """Generate, reward and filter until `rollout_batch_size` groups are kept (module docstring).
    `report` receives the progress lines (rank 0 only; None: silent)."""
    started = time.perf_counter()
    if ranks is not None and ranks.rank != 0:
        report = None
    last_report = started
    engine.reset_stats()
    target, per_batch, n = cfg.rollout_batch_size, cfg.over_sampling_batch_size, cfg.n_samples_per_prompt
    limit = max(len(dataset), target)
    kept: list[Group] = []
    dropped: Counter[str] = Counter()
    mine = _Submitted()
    in_flight = consumed = num_finished = num_tokens = num_late = 0   # counts over all ranks
    reward_seconds = 0.0
    while len(kept) < target:
        while len(kept) + in_flight < target and consumed < limit:
            prompts = dataset.next_batch(per_batch)
            share = rank_share(len(prompts), ranks)
            for i in range(share.start, share.stop):
                gid = consumed + i
                rid = engine.new_request_id()
                engine.add(Request(request_id=rid, prompt_ids=prompts[i].token_ids, params=cfg.sampling, n=n,
                                   seed=derive_seed(cfg.seed, rollout_id, gid),
                                   sample_max_new_tokens=context_cap(cfg, len(prompts[i].token_ids))))
                mine.requests[rid] = (prompts[i], gid, [])
            consumed += len(prompts)
            in_flight += len(prompts)
        if in_flight == 0:
            raise RolloutError(
                f"dynamic sampling filter kept {len(kept)}/{target} groups after a full pass over {consumed} "
                f"prompts (data set has {len(dataset)}); rewards may all be equal (e.g. all 0)")
        finished = mine.collect(engine.step() if engine.has_work() else [], n)
        t = time.perf_counter()
        reward_groups(finished, reward_fn)
        reward_seconds += time.perf_counter() - t
        finished = gather_lists(finished, ranks)
        in_flight -= len(finished)
        num_finished += len(finished)
        for g in finished:
            num_tokens += sum(len(s.response_ids) for s in g.samples)
            if len(kept) >= target:
                num_late += 1     # finished in the step that completed the batch: not used, aborted
                continue
            if filter_fn is not None and not filter_fn(g):
                dropped[filter_fn.name] += 1
            else:
                kept.append(g)
        now = time.perf_counter()
        if report is not None and now - last_report >= report_every_s and len(kept) < target:
            last_report = now
            report(f"[rollout {rollout_id + 1} generating] {num_finished * n} samples done | groups kept "
                   f"{len(kept)}/{target}, dropped {sum(dropped.values())}, in flight {in_flight} | "
                   f"{num_tokens / max(now - started, 1e-9):.0f} tok/s (finished groups) | {now - started:.0f}s")
    num_aborted = in_flight + num_late
    aborted = engine.abort(set(mine.requests))
    num_tokens += sum(gather_lists([len(c.token_ids) for c in aborted], ranks))
    stats = engine.reset_stats()
    metrics = _summarize(kept, dict(dropped), num_aborted, num_finished, num_tokens,
                         time.perf_counter() - started, reward_seconds, stats)
    return RolloutBatch(groups=kept, metrics=metrics)


def context_cap(cfg: RolloutConfig, num_prompt_tokens: int) -> list[int] | None:
    """Per-sample max_new_tokens when --rollout-max-context-len leaves less room than the response limit."""
    if cfg.max_context_len is None:
        return None
    room = cfg.max_context_len - num_prompt_tokens
    return None if room >= cfg.sampling.max_new_tokens else [room] * cfg.n_samples_per_prompt


def engine_metrics(stats: Any) -> dict[str, float]:
    """The engine's counters of one rollout as perf/ metrics (this rank's engine)."""
    return {
        "perf/decode_steps_per_s": stats.num_decode_steps / max(stats.seconds, 1e-9),
        "perf/rollout_mean_running_batch": stats.mean_batch,
        "perf/rollout_kv_utilization": stats.kv_utilization,
        "perf/rollout_cascade_row_fraction": stats.grouped_fraction,
        "perf/rollout_num_preemptions": float(stats.num_preemptions),
    }


def _summarize(kept: list[Group], dropped: dict[str, int], num_aborted: int, num_finished: int,
               num_generated_tokens: int, seconds: float, reward_seconds: float, stats: Any,
               num_failed: int = 0) -> RolloutMetrics:
    samples = [s for g in kept for s in g.samples]
    lens = [len(s.response_ids) for s in samples]
    num = max(len(samples), 1)
    num_trained = sum(s.num_trained_tokens for s in samples)
    model_lp = sum(sum(s.rollout_log_probs) if s.loss_mask is None else
                   sum(lp for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m) for s in samples)
    return RolloutMetrics(
        num_dropped=dropped, num_aborted=num_aborted, num_generated_groups=num_finished,
        raw_reward=sum(s.reward for s in samples) / num,
        response_len_mean=sum(lens) / num, response_len_max=max(lens, default=0),
        truncated_ratio=sum(s.truncated for s in samples) / num,
        rollout_log_probs=model_lp / max(num_trained, 1),   # model tokens only: tool tokens have no log-prob
        num_generated_tokens=num_generated_tokens, seconds=seconds, reward_seconds=reward_seconds,
        engine=engine_metrics(stats), trained_tokens_mean=num_trained / num,
        turns_mean=sum(s.num_turns for s in samples) / num, num_failed_samples=num_failed)
