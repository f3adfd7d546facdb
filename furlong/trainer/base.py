"""What the actor and the critic share (docs/design.md §2, §5): a model sharded with FSDP2 (fp32
masters), its optimizer and LR schedule, the rank split and micro-batch plan of a rollout's samples,
one optimizer step, and the no-grad pass over every rank's share (no_grad_pass.py).

Every rank gets ALL samples of the rollout and runs the same pure planning functions on them, so the
rank split, each rank's micro-batch plan, the common micro-batch count (max over ranks), the global
batch size and the global count of loss tokens are known on every rank without any collective.

One optimizer step (`Trainer._optimizer_step`):
  1. split the step's samples over ranks, token-balanced; plan this rank's micro-batches (dynamic:
     token budget; else fixed size), padded with 1-token zero-weight micro-batches up to the max
     count over ranks, so that every rank runs the same FSDP collectives;
  2. per micro-batch: the trainer's objective (forward -> loss) -> backward. The loss weights carry
     the global aggregation (batching.py) and FSDP sums gradients over ranks (fsdp.py), so the
     result equals one big batch;
  3. clip the global gradient norm, sum the step's loss metrics over ranks, bring both to the host
     in ONE copy (the step's one host sync: the metrics are logged, and a non-finite norm must skip
     the update), step the optimizer unless the norm is non-finite (it is global, so every rank
     decides alike), and the LR schedule in any case.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable

import torch
import torch.distributed as dist

from furlong.config import OptimConfig
from furlong.trainer.batching import pack_micro_batch, padding_micro_batch
from furlong.trainer.device_timer import DeviceTimer
from furlong.trainer.fsdp import micro_batch_sync, prepare_trainer_model
from furlong.trainer.metrics import StepResult
from furlong.trainer.no_grad_pass import PositionFn, gathered_forward
from furlong.trainer.optimizer import build_lr_scheduler, build_optimizer
from furlong.trainer.trainer_config import BatchingConfig, ShardConfig
from furlong.types import DistContext, MicroBatch, TrainSample, WeightedSums

log = logging.getLogger(__name__)

# (micro-batch on the host, the step's samples) -> (loss with grad, its metrics on the device)
MicroLoss = Callable[[MicroBatch, list[TrainSample]], tuple[torch.Tensor, WeightedSums]]


class Trainer:
    def __init__(self, model: torch.nn.Module, shard: ShardConfig, optim: OptimConfig, total_steps: int,
                 ctx: DistContext, name: str):
        """`model`: unsharded (any device/dtype; sharded in place, fp32 masters). total_steps: optimizer
        steps of the LR schedule. `name` says whose step a log line is about."""
        self.ctx, self.name, self.shard, self.clip_grad = ctx, name, shard, optim.clip_grad
        self.model = prepare_trainer_model(model, ctx, shard).train()
        self.optimizer = build_optimizer(self.model, optim, offload_moments=shard.optimizer_offload)
        self.scheduler = build_lr_scheduler(self.optimizer, optim, total_steps)

    def enable_reshard_after_forward(self) -> None:
        """From now on free each layer's gathered compute-dtype weights after its forward and gather them
        again for its backward (--fsdp-reshard-after-forward; the memory plan turns it on when nothing
        fits without it). `self.shard` is the live placement; the trainer's Config keeps the flags given."""
        for layer in self.model.layers:     # the root stays gathered (fsdp.shard_model)
            layer.set_reshard_after_forward(True, recurse=False)
        self.shard = dataclasses.replace(self.shard, reshard_after_forward=True)

    def _gathered(self, model: torch.nn.Module, samples: list[TrainSample], steps: BatchingConfig,
                  forward: PositionFn) -> list[torch.Tensor]:
        """`forward`'s values [R] of every sample (no grad; each rank its share, then all-gathered)."""
        return gathered_forward(model, samples, steps.plan([s.num_tokens for s in samples], self.ctx.world_size),
                                self.ctx, forward)

    def _optimizer_steps(self, samples: list[TrainSample], steps: BatchingConfig, micro_loss: MicroLoss,
                         metrics_type: type[WeightedSums]) -> list[StepResult]:
        """Every optimizer step of one rollout's samples (identical list on every rank)."""
        if not samples:
            raise ValueError(f"{self.name} train_step: no samples")
        return [self._optimizer_step([samples[i] for i in idx], steps, micro_loss, metrics_type)
                for idx in steps.step_chunks(len(samples))]

    def _optimizer_step(self, samples: list[TrainSample], steps: BatchingConfig, micro_loss: MicroLoss,
                        metrics_type: type[WeightedSums]) -> StepResult:
        ctx = self.ctx
        lengths = [s.num_tokens for s in samples]
        split, plans = steps.plan(lengths, ctx.world_size)
        mine, num_mb = plans[ctx.rank], max(len(p) for p in plans)
        # global aggregation, known locally because every rank holds all of the step's samples
        weights, means = steps.loss_weights(samples), steps.metric_weights(samples)
        has_old, has_ref = samples[0].old_log_probs is not None, samples[0].ref_log_probs is not None
        total = metrics_type.zeros(ctx.device)
        self.optimizer.zero_grad(set_to_none=True)
        for k in range(num_mb):
            micro_batch_sync(self.model, k, num_mb, self.shard.reshard_after_forward)
            mb = (pack_micro_batch(samples, weights, mine[k], means) if k < len(mine)
                  else padding_micro_batch(has_old, has_ref))
            loss, metrics = micro_loss(mb, samples)
            loss.backward()
            total = total + metrics
        host, norm, lr, timer = self._finish(total.stacked())
        rank_tokens = [sum(lengths[i] for i in idx) for idx in split]
        mean_tokens = sum(rank_tokens) / len(rank_tokens)
        return StepResult(metrics=metrics_type.from_host(host), grad_norm=norm, finite=math.isfinite(norm), lr=lr,
                          num_micro_batches=num_mb, num_tokens=sum(lengths),
                          tokens_max_over_mean=max(rank_tokens) / mean_tokens if mean_tokens > 0 else 1.0,
                          optimizer_timer=timer)

    def _finish(self, stacked: torch.Tensor) -> tuple[list[float], float, float, DeviceTimer | None]:
        """Step 3 of the module docstring: (rank-summed metrics [M] on the host, grad norm, lr used, the
        optimizer step's timer: None when it was skipped). stacked [M]: this rank's loss metrics;
        --clip-grad 0 means no clipping."""
        clip = self.clip_grad if self.clip_grad > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if self.ctx.world_size > 1:
            dist.all_reduce(stacked)
        host = torch.cat([stacked, grad_norm.reshape(1).float().to(stacked.device)]).tolist()
        norm, lr = host[-1], self.scheduler.get_last_lr()[0]
        timer = None
        if math.isfinite(norm):
            timer = DeviceTimer(self.ctx.device)
            self.optimizer.step()
            timer.stop()
        else:
            log.warning("%s: skipping optimizer step: grad norm is %s", self.name, norm)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return host[:-1], norm, lr, timer

    def reset_optimizer_state(self) -> None:
        """--reset-optimizer-states: zero AdamW's moments and step counts (Megatron's reset in miles); the
        LR schedule goes on."""
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
