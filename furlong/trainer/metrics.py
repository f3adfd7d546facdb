"""What a train step reports: StepResult per optimizer step, TrainMetrics (CriticMetrics) per rollout.

StepResult lives on the host after each optimizer step; TrainMetrics sums a rollout's steps
and is logged as `train/*`, the critic's CriticMetrics as `critic/*` (docs/design.md §7)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from furlong.algorithms.losses import LossMetrics


@dataclass
class TrainMetrics:
    """One train_step (all optimizer steps of a rollout); loss terms are step means."""
    loss: float
    pg_loss: float
    pg_clipfrac: float
    ppo_kl: float
    entropy: float
    kl_loss: float
    rollout_logprob_abs_diff: float   # mean |trainer - engine| log-prob of the trained tokens (same weights)
    grad_norm: float              # before clipping, mean over steps
    lr: float                     # learning rate of the last step
    num_steps: int                # optimizer steps taken
    num_skipped_steps: int        # steps skipped for a non-finite grad norm
    num_micro_batches: int        # per rank (all ranks run the same count), summed over steps
    tokens_max_over_mean: float   # rank token balance: max rank tokens / mean (1.0 = perfect)
    num_tokens: int               # prompt + response tokens trained, all ranks
    seconds: float

    def to_log(self) -> dict[str, float]:
        """`train/*` metric names of docs/design.md §7."""
        return {f"train/{f.name}": getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "seconds"}


@dataclass
class StepResult:
    """One optimizer step, on the host."""
    metrics: LossMetrics          # step aggregates, 0-d CPU tensors (summed over micro-batches and ranks)
    grad_norm: float
    finite: bool                  # False: non-finite grad norm, update skipped
    lr: float
    num_micro_batches: int
    num_tokens: int
    tokens_max_over_mean: float


@dataclass
class CriticMetrics:
    """One Critic.train_step (all optimizer steps of a rollout); loss terms are step means."""
    value_loss: float
    value_clipfrac: float
    explained_variance: float     # of the returns by the pre-update values (value_loss.py)
    grad_norm: float              # before clipping, mean over steps
    lr: float                     # learning rate of the last step
    num_steps: int
    num_skipped_steps: int
    seconds: float

    def to_log(self) -> dict[str, float]:
        """`critic/*` metric names (docs/design.md §7; miles logs train/critic-value_loss, ...)."""
        return {f"critic/{f.name}": getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "seconds"}
