"""PPO's critic: the value model, sharded and trained like the actor (docs/design.md §2, §5).

Per rollout, in miles' order (the critic before the actor):
  1. `compute_values(samples)`: V of every response token, [R] per sample, under the current
     critic (no grad; each rank its token-balanced share, then all-gathered), from which
     GAE makes advantages and returns (run/step.py);
  2. `train_step(samples)`: the actor's optimizer steps per rollout (--global-batch-size /
     --num-steps-per-rollout), rank split, micro-batch plan and loss weights (--loss-agg-mode),
     so FSDP's summed gradients equal one big batch; the objective is value_loss.value_loss
     against the returns, clipped around step 1's values by --value-clip.

The critic's optimizer is the actor's (--optimizer, betas, weight decay, --clip-grad, decay
style) with its own --critic-lr (default --lr) and --critic-lr-warmup-iters: miles swaps
exactly these two into the critic's arguments (specs.critic_spec). Its weights start from
--critic-hf-checkpoint (default --hf-checkpoint) with a fresh value head (models/value_model.py).
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch

from furlong.models.value_model import ValueModel
from furlong.trainer.batching import move_micro_batch, pack_micro_batch, padding_micro_batch, response_slices
from furlong.trainer.fsdp import micro_batch_sync, prepare_trainer_model
from furlong.trainer.no_grad_pass import gathered_forward
from furlong.trainer.optimizer import build_lr_scheduler, build_optimizer
from furlong.trainer.optimizer_step import finish_step
from furlong.trainer.metrics import CriticMetrics
from furlong.trainer.spec import CriticSpec
from furlong.algorithms.value_loss import ValueLossMetrics, explained_variance, value_loss
from furlong.types import DistContext, MicroBatch, TrainSample



@dataclasses.dataclass
class CriticStep:
    """One optimizer step of the critic, on the host."""
    metrics: ValueLossMetrics     # summed over the step's micro-batches and ranks (0-d CPU tensors)
    grad_norm: float              # before clipping; non-finite: the update was skipped
    lr: float                     # the learning rate the step used


class Critic:
    def __init__(self, model: ValueModel, spec: CriticSpec, ctx: DistContext, max_tokens_per_gpu: int | None = None):
        """`model`: the unsharded value model (sharded in place, fp32 masters). max_tokens_per_gpu: the
        budget under --max-tokens-per-gpu auto (else the spec's), or set `critic.max_tokens_per_gpu` later."""
        self.spec, self.ctx = spec, ctx
        self.model = prepare_trainer_model(model, ctx, spec.shard).train()
        self.optimizer = build_optimizer(self.model, spec.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, spec.optim, spec.total_steps)
        self.max_tokens_per_gpu = max_tokens_per_gpu if max_tokens_per_gpu is not None else spec.steps.max_tokens_per_gpu

    def _plan(self, samples: list[TrainSample]) -> tuple[list[list[int]], list[list[list[int]]]]:
        """Rank split and per-rank micro-batches, the actor's planner on the same samples."""
        return self.spec.steps.plan([s.num_tokens for s in samples], self.ctx.world_size, self.max_tokens_per_gpu)

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        """Values [T] fp32 at every packed position of mb (already on the device)."""
        return self.model.forward_packed(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)

    def compute_values(self, samples: list[TrainSample]) -> list[torch.Tensor]:
        """Values [R] (fp32, CPU) of every sample's response tokens, on every rank (no_grad_pass)."""
        return gathered_forward(self.model, samples, self._plan(samples), self.ctx,
                                lambda mb, slices: self._values(mb))

    def train_step(self, samples: list[TrainSample]) -> CriticMetrics:
        """All optimizer steps of one rollout; samples carry `values` and `returns` (identical on every rank)."""
        if not samples:
            raise ValueError("Critic.train_step: no samples")
        if any(s.values is None or s.returns is None for s in samples):
            raise ValueError("Critic.train_step: samples need values and returns (run/step.py: values, advantages)")
        t0 = time.perf_counter()
        steps = [self._optimizer_step([samples[i] for i in idx]) for idx in self.spec.steps.step_chunks(len(samples))]
        finite = [st for st in steps if math.isfinite(st.grad_norm)] or steps
        masks = [s.loss_mask if s.loss_mask is not None else torch.ones(s.num_response_tokens) for s in samples]
        return CriticMetrics(
            value_loss=sum(st.metrics.value_loss.item() for st in steps) / len(steps),
            value_clipfrac=sum(st.metrics.value_clipfrac.item() for st in steps) / len(steps),
            explained_variance=explained_variance([s.values for s in samples], [s.returns for s in samples], masks),
            grad_norm=sum(st.grad_norm for st in finite) / len(finite), lr=steps[-1].lr, num_steps=len(steps),
            num_skipped_steps=sum(not math.isfinite(st.grad_norm) for st in steps), seconds=time.perf_counter() - t0)

    def _packed(self, mb: MicroBatch, samples: list[TrainSample], field: str) -> torch.Tensor:
        """A per-sample [R] field of mb's samples placed at its response positions, [T] (0 elsewhere)."""
        out = torch.zeros(mb.num_tokens, dtype=torch.float32)
        for i, (s, e) in zip(mb.sample_indices, response_slices(mb, samples)):
            out[s:e] = getattr(samples[i], field).float()
        return out

    def _optimizer_step(self, samples: list[TrainSample]) -> "CriticStep":
        spec, ctx = self.spec, self.ctx
        split, plans = self._plan(samples)
        mine, num_mb = plans[ctx.rank], max(len(p) for p in plans)
        weights = spec.steps.loss_weights(samples)
        total = ValueLossMetrics.zeros(ctx.device)
        self.optimizer.zero_grad(set_to_none=True)
        for k in range(num_mb):
            micro_batch_sync(self.model, k, num_mb, spec.shard.reshard_after_forward)
            mb = pack_micro_batch(samples, weights, mine[k]) if k < len(mine) else padding_micro_batch(False, False)
            old, returns = self._packed(mb, samples, "values"), self._packed(mb, samples, "returns")
            mb = move_micro_batch(mb, ctx.device)
            loss, metrics = value_loss(self._values(mb), old.to(ctx.device), returns.to(ctx.device),
                                       mb.loss_weight, spec.value_clip)
            loss.backward()
            total = total + metrics
        host, norm, lr = finish_step(self.model, self.optimizer, self.scheduler, total.stacked(),
                                     spec.optim.clip_grad, ctx.world_size, "critic")
        return CriticStep(ValueLossMetrics(*(torch.tensor(v) for v in host)), norm, lr)


def build_critic(spec: CriticSpec, ctx: DistContext, checkpoint_dir: Path,
                 max_tokens_per_gpu: int | None = None) -> Critic:
    """The critic of a ppo run: the decoder of `checkpoint_dir` (checked by run set-up) with a value
    head seeded by spec.head_seed, so every rank and world size starts from the same head."""
    from furlong.models.hf_io import load_pretrained
    decoder = load_pretrained(checkpoint_dir, dtype=torch.float32, device=ctx.device)
    head_seed = torch.Generator().manual_seed(spec.head_seed)
    return Critic(ValueModel(decoder, head_seed), spec, ctx, max_tokens_per_gpu=max_tokens_per_gpu)
