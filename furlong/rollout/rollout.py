"""One rollout: prompt groups -> responses -> rewards -> dynamic filter (docs/design.md §2 steps 1-2, §6).

Streaming over-sampling, as miles does it: whenever the groups kept plus the
groups in flight fall short of `rollout_batch_size`, the next
`over_sampling_batch_size` prompts are drawn and submitted to the engine as one
request each (n samples, prefilled once). As soon as all n samples of a group
have finished, the group is rewarded and passed through the filter while
generation goes on: passing groups are kept, failing ones dropped (counted per
filter name). Once `rollout_batch_size` groups are kept, every request still in
flight is aborted; those groups count as `num_aborted`. With --partial-rollout they
are paused instead (partial.py): a buffer, drawn from before any new prompt in the
next rollout, where their unfinished samples continue under the new weights.
Groups that finish in the engine step that completed the batch are aborted either way.

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
samples do not depend on the number of ranks (a resumed group keeps the seed of the
rollout that first drew it). The groups one rank paused are exchanged the same way.

Progress: rank 0 reports a line at least every `REPORT_EVERY_S` seconds while a rollout runs
(samples done, groups kept/dropped/in flight, generated tokens per second), so a rollout that
keeps dropping groups is never silent; `give_up_rule` states the bound above at start-up.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from furlong.engine.sampling import SamplingParams
from furlong.rewards.registry import compute_rewards
from furlong.rollout.filters import GroupFilter
from furlong.rollout.in_flight import InFlight
from furlong.rollout.partial import PausedGroup, PausedGroups
from furlong.rollout.rollout_metrics import RolloutMetrics, summarize
from furlong.types import DistContext, Group, Sample

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
    partial_rollout: bool = False        # --partial-rollout: pause unfinished groups, not abort them (partial.py)
    mask_offpolicy: bool = False         # --mask-offpolicy-in-partial-rollout: their earlier tokens do not train


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


def generate_rollout(dataset: PromptDataset, engine: Engine, reward_fn: Callable[[Sample], Any],
                     filter_fn: GroupFilter | None, cfg: RolloutConfig, ranks: DistContext | None,
                     rollout_id: int, report: Callable[[str], None] | None = _print_line,
                     report_every_s: float = REPORT_EVERY_S, paused: PausedGroups | None = None) -> RolloutBatch:
    """Generate, reward and filter until `rollout_batch_size` groups are kept (module docstring).
    `report` receives the progress lines (rank 0 only; None: silent). `paused`: --partial-rollout's buffer
    (the same on every rank), drawn from first and given this rollout's unfinished groups at its end."""
    started = time.perf_counter()
    if ranks is not None and ranks.rank != 0:
        report = None
    last_report = started
    engine.reset_stats()
    target, per_batch, n = cfg.rollout_batch_size, cfg.over_sampling_batch_size, cfg.n_samples_per_prompt
    limit = max(len(dataset), target)
    kept: list[Group] = []
    dropped: Counter[str] = Counter()
    mine = InFlight(engine, cfg.sampling, rollout_id, cfg.mask_offpolicy)
    in_flight = consumed = num_finished = num_tokens = num_late = 0   # counts over all ranks
    num_resumed = num_offpolicy = 0
    reward_seconds = 0.0
    while len(kept) < target:
        while len(kept) + in_flight < target and consumed < limit:
            items: list[Any] = paused.take(per_batch) if paused is not None else []
            num_resumed += sum(pg.num_samples for pg in items)
            if len(items) < per_batch:
                items += dataset.next_batch(per_batch - len(items))
            share = rank_share(len(items), ranks)
            for i in range(share.start, share.stop):
                gid, item = consumed + i, items[i]
                if isinstance(item, PausedGroup):
                    mine.resume(item, gid, context_cap(cfg, len(item.group.samples[0].prompt.token_ids)))
                else:
                    mine.submit(item, gid, derive_seed(cfg.seed, rollout_id, gid), n,
                                context_cap(cfg, len(item.token_ids)))
            consumed += len(items)
            in_flight += len(items)
        if in_flight == 0:
            raise RolloutError(
                f"dynamic sampling filter kept {len(kept)}/{target} groups after a full pass over {consumed} "
                f"prompts (data set has {len(dataset)}); rewards may all be equal (e.g. all 0)")
        finished = mine.collect(engine.step() if engine.has_work() else [])
        t = time.perf_counter()
        reward_groups([f.group for f in finished], reward_fn)
        reward_seconds += time.perf_counter() - t
        finished = gather_lists(finished, ranks)
        in_flight -= len(finished)
        num_finished += len(finished)
        for f in finished:
            g = f.group
            num_tokens += f.num_new_tokens
            if len(kept) >= target:
                num_late += 1     # finished in the step that completed the batch: not used, aborted
                continue
            if filter_fn is not None and not filter_fn(g):
                dropped[filter_fn.name] += 1
            else:
                kept.append(g)
                num_offpolicy += f.num_offpolicy_tokens
        now = time.perf_counter()
        if report is not None and now - last_report >= report_every_s and len(kept) < target:
            last_report = now
            report(f"[rollout {rollout_id + 1} generating] {num_finished * n} samples done | groups kept "
                   f"{len(kept)}/{target}, dropped {sum(dropped.values())}, in flight {in_flight} | "
                   f"{num_tokens / max(now - started, 1e-9):.0f} tok/s (finished groups) | {now - started:.0f}s")
    mine_paused, num_stopped_tokens = mine.stop(pause=paused is not None)
    num_tokens += sum(gather_lists([num_stopped_tokens], ranks))
    stats = engine.reset_stats()
    metrics = summarize(kept, dict(dropped), in_flight + num_late if paused is None else num_late, num_finished,
                        num_tokens, time.perf_counter() - started, reward_seconds, stats)
    if paused is not None:
        # by group id: every rank holds the same buffer, in an order that does not depend on the rank count
        now_paused = sorted(gather_lists(mine_paused, ranks), key=lambda pg: pg.group.group_id)
        paused.put(now_paused)
        metrics.num_partial_resumed, metrics.num_partial_paused = num_resumed, sum(pg.num_samples for pg in now_paused)
        metrics.partial_offpolicy_token_frac = num_offpolicy / max(sum(len(s.response_ids) for g in kept
                                                                       for s in g.samples), 1)
    return RolloutBatch(groups=kept, metrics=metrics)


def context_cap(cfg: RolloutConfig, num_prompt_tokens: int) -> list[int] | None:
    """Per-sample max_new_tokens when --rollout-max-context-len leaves less room than the response limit."""
    if cfg.max_context_len is None:
        return None
    room = cfg.max_context_len - num_prompt_tokens
    return None if room >= cfg.sampling.max_new_tokens else [room] * cfg.n_samples_per_prompt
