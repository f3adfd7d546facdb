"""PPO's critic: the value model, sharded and trained like the actor (docs/design.md §2, §5).

Per rollout, in miles' order (the critic before the actor), with the actor's BatchingConfig:
  1. `compute_values(samples, steps)`: V of every response token, [R] per sample, under the current
     critic (no grad; each rank its token-balanced share, then all-gathered), from which
     GAE makes advantages and returns (run/step.py);
  2. `train_step(samples, steps)`: the actor's optimizer steps per rollout (--global-batch-size /
     --num-steps-per-rollout), rank split, micro-batch plan and loss weights (--loss-agg-mode),
     so FSDP's summed gradients equal one big batch; the objective is value_loss.value_loss
     against the returns, clipped around step 1's values by --value-clip.

The critic's optimizer is the actor's (--optimizer, betas, weight decay, --clip-grad, decay
style) with its own --critic-lr (default --lr) and --critic-lr-warmup-iters: miles swaps
exactly these two into the critic's arguments (config_map.critic_config). Its weights start from
--critic-hf-checkpoint (default --hf-checkpoint) with a fresh value head (models/value_model.py).
Sharding, planning, the optimizer step and the no-grad pass are the trainer base's (base.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from furlong.algorithms.value_loss import ValueLossMetrics, explained_variance, value_loss
from furlong.config import OptimConfig
from furlong.models.value_model import ValueModel
from furlong.trainer.base import Trainer
from furlong.trainer.batching import move_micro_batch, response_slices
from furlong.trainer.metrics import CriticMetrics, loss_means, step_summary
from furlong.trainer.trainer_config import BatchingConfig, ShardConfig
from furlong.types import DistContext, MicroBatch, TrainSample


class Critic(Trainer):
    @dataclass(frozen=True)
    class Config:
        shard: ShardConfig
        optim: OptimConfig           # the actor's with --critic-lr and --critic-lr-warmup-iters
        value_clip: float            # clip of new values around step 1's (value_loss.py)
        total_steps: int             # optimizer steps of the LR schedule
        head_seed: int               # seeds the fresh value head: the same on every rank and world size

    def __init__(self, model: ValueModel, cfg: Critic.Config, ctx: DistContext):
        """`model`: the unsharded value model (sharded in place, fp32 masters)."""
        super().__init__(model, cfg.shard, cfg.optim, cfg.total_steps, ctx, "critic")
        self.cfg = cfg

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        """Values [T] fp32 at every packed position of mb (already on the device)."""
        return self.model.forward_packed(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)

    def compute_values(self, samples: list[TrainSample], steps: BatchingConfig) -> list[torch.Tensor]:
        """Values [R] (fp32, CPU) of every sample's response tokens, on every rank (no_grad_pass)."""
        return self._gathered(self.model, samples, steps, lambda mb, slices: self._values(mb))

    def train_step(self, samples: list[TrainSample], steps: BatchingConfig) -> CriticMetrics:
        """All optimizer steps of one rollout; samples carry `values` and `returns` (identical on every rank)."""
        if any(s.values is None or s.returns is None for s in samples):
            raise ValueError("Critic.train_step: samples need values and returns (run/step.py: values, advantages)")
        t0 = time.perf_counter()
        results = self._optimizer_steps(samples, steps, self._micro_loss, ValueLossMetrics)
        masks = [s.loss_mask if s.loss_mask is not None else torch.ones(s.num_response_tokens) for s in samples]
        ev = explained_variance([s.values for s in samples], [s.returns for s in samples], masks)
        return CriticMetrics(**loss_means(results), explained_variance=ev, **step_summary(results),
                             seconds=time.perf_counter() - t0)

    def _micro_loss(self, mb: MicroBatch, samples: list[TrainSample]) -> tuple[torch.Tensor, ValueLossMetrics]:
        old, returns = _packed(mb, samples, "values"), _packed(mb, samples, "returns")
        mb = move_micro_batch(mb, self.ctx.device)
        return value_loss(self._values(mb), old.to(self.ctx.device), returns.to(self.ctx.device), mb.loss_weight,
                          self.cfg.value_clip)


def _packed(mb: MicroBatch, samples: list[TrainSample], field: str) -> torch.Tensor:
    """A per-sample [R] field of mb's samples placed at its response positions, [T] (0 elsewhere)."""
    out = torch.zeros(mb.num_tokens, dtype=torch.float32)
    for i, (s, e) in zip(mb.sample_indices, response_slices(mb, samples)):
        out[s:e] = getattr(samples[i], field).float()
    return out


def build_critic(cfg: Critic.Config, ctx: DistContext, checkpoint_dir: Path) -> Critic:
    """The critic of a ppo run: the decoder of `checkpoint_dir` (checked by run set-up) with a value
    head seeded by cfg.head_seed, so every rank and world size starts from the same head."""
    from furlong.models.hf_io import load_pretrained
    decoder = load_pretrained(checkpoint_dir, dtype=torch.float32, device=ctx.device)
    head_seed = torch.Generator().manual_seed(cfg.head_seed)
    return Critic(ValueModel(decoder, head_seed), cfg, ctx)
