"""What a train step reports: StepResult per optimizer step (actor and critic alike), TrainMetrics
(the actor's) and CriticMetrics per rollout.

StepResult lives on the host after each optimizer step; a rollout's steps are summarized by the
shared helpers here, logged as `train/*` (actor) and `critic/*` (critic) (docs/design.md §7)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from furlong.trainer.device_timer import DeviceTimer
from furlong.types import WeightedSums


@dataclass
class StepResult:
    """One optimizer step of either trainer, on the host."""
    metrics: WeightedSums         # the loss's sums over the step's micro-batches and ranks (0-d CPU tensors)
    grad_norm: float              # before clipping
    finite: bool                  # False: non-finite grad norm, update skipped
    lr: float                     # the learning rate the step used
    num_micro_batches: int        # per rank (all ranks run the same count)
    num_tokens: int               # prompt + response tokens of the step, all ranks
    tokens_max_over_mean: float   # rank token balance: max rank tokens / mean (1.0 = perfect)
    optimizer_timer: DeviceTimer | None = None   # optimizer.step() on the device (None: skipped or not timed)


def loss_means(steps: list[StepResult]) -> dict[str, float]:
    """Each loss metric's mean over a rollout's optimizer steps."""
    names = [f.name for f in dataclasses.fields(steps[0].metrics)]
    return {n: sum(float(getattr(st.metrics, n)) for st in steps) / len(steps) for n in names}


def step_summary(steps: list[StepResult]) -> dict[str, float | int]:
    """grad_norm (mean over the finite steps; over all when none is), lr (the last step's), num_steps,
    num_skipped_steps (non-finite grad norm), optimizer_step_seconds (the optimizer steps' device time,
    summed; read here, after the last step, so that timing them costs no host wait per step)."""
    finite = [st for st in steps if st.finite] or steps
    return {"grad_norm": sum(st.grad_norm for st in finite) / len(finite), "lr": steps[-1].lr,
            "num_steps": len(steps), "num_skipped_steps": sum(not st.finite for st in steps),
            "optimizer_step_seconds": sum(st.optimizer_timer.seconds() for st in steps
                                          if st.optimizer_timer is not None)}


@dataclass
class TrainMetrics:
    """One Actor.train_step (all optimizer steps of a rollout); loss terms are step means."""
    loss: float
    pg_loss: float
    pg_clipfrac: float
    ppo_kl: float
    entropy: float
    kl_loss: float
    rollout_logprob_abs_diff: float   # mean |trainer - engine| log-prob of the trained tokens (same weights)
    ois: float                    # mean new/old ratio exp(logp - old) (algorithms/mismatch.py says when logged)
    grad_norm: float              # before clipping, mean over steps
    lr: float                     # learning rate of the last step
    num_steps: int                # optimizer steps taken
    num_skipped_steps: int        # steps skipped for a non-finite grad norm
    num_micro_batches: int        # per rank (all ranks run the same count), summed over steps
    tokens_max_over_mean: float   # rank token balance: max rank tokens / mean (1.0 = perfect)
    num_tokens: int               # prompt + response tokens trained, all ranks
    seconds: float
    optimizer_step_seconds: float = 0.0   # optimizer.step() of every step, device time (perf/optimizer_step_time)

    @classmethod
    def of(cls, steps: list[StepResult], seconds: float) -> TrainMetrics:
        return cls(**loss_means(steps), **step_summary(steps),
                   num_micro_batches=sum(st.num_micro_batches for st in steps),
                   tokens_max_over_mean=max(st.tokens_max_over_mean for st in steps),
                   num_tokens=sum(st.num_tokens for st in steps), seconds=seconds)

    def to_log(self) -> dict[str, float]:
        """`train/*` metric names of docs/design.md §7, and perf/optimizer_step_time."""
        out = {f"train/{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("seconds", "optimizer_step_seconds")}
        return {**out, "perf/optimizer_step_time": self.optimizer_step_seconds}


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
    optimizer_step_seconds: float = 0.0   # as TrainMetrics' (perf/critic_optimizer_step_time)

    def to_log(self) -> dict[str, float]:
        """`critic/*` metric names (docs/design.md §7; miles logs train/critic-value_loss, ...), and
        perf/critic_optimizer_step_time."""
        out = {f"critic/{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("seconds", "optimizer_step_seconds")}
        return {**out, "perf/critic_optimizer_step_time": self.optimizer_step_seconds}
