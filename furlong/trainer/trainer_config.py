"""What both trainers (actor.py, critic.py) are configured with besides their own `Config`.

`ShardConfig`: how a trainer's model is placed. `BatchingConfig`: how one rollout's samples become
optimizer steps, micro-batches and loss weights. The step runs actor and critic with the SAME
BatchingConfig (run/step.py passes one value to both), so their gradients aggregate alike
(docs/design.md §5); under --max-tokens-per-gpu auto its token budget is the memory probe's result,
put into the run's config (run/setup.py) before the first step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from furlong.trainer.batching import step_loss_weights, step_metric_weights
from furlong.trainer.planning import optimizer_step_chunks, rank_micro_batches

if TYPE_CHECKING:
    import torch

    from furlong.types import TrainSample

RankPlan = tuple[list[list[int]], list[list[list[int]]]]   # rank split, per-rank micro-batches (indices)


@dataclass(frozen=True)
class ShardConfig:
    """How a trainer's model is placed: FSDP2 with fp32 masters, compute in `dtype`."""
    dtype: str                       # --dtype: auto | bf16 | fp32 (fsdp.compute_dtype resolves it per device)
    torch_compile: str               # --torch-compile: auto (on CUDA) | on | off
    gradient_checkpointing: bool     # recompute decoder layers in backward
    # False: a layer's gathered weights stay from its first forward of an optimizer step to the step's
    # last backward (fsdp.micro_batch_sync); True: FSDP's default, gathered again in every backward
    reshard_after_forward: bool
    # --fsdp-cpu-offload: fp32 master shards, their gradients and AdamW state in CPU memory; layers are
    # copied to the GPU for their forward/backward and the optimizer step runs on the CPU
    cpu_offload: bool = False
    # --optimizer-cpu-offload: AdamW's moments in pinned CPU memory, streamed to the GPU for each update
    # (trainer/optimizer_offload.py); masters and gradients stay where cpu_offload puts them (the GPU)
    optimizer_offload: bool = False


@dataclass(frozen=True)
class BatchingConfig:
    """How one rollout's samples become optimizer steps, micro-batches and loss weights."""
    global_batch_size: int | None    # samples per optimizer step (None: all of the rollout's)
    num_steps_per_rollout: int | None   # wins over global_batch_size when set
    use_dynamic_batch_size: bool     # micro-batches packed by token count
    max_tokens_per_gpu: int | None   # token budget per micro-batch (None under 'auto' until probed)
    micro_batch_size: int            # samples per micro-batch without dynamic batching
    loss_agg_mode: str               # --loss-agg-mode (batching.token_loss_weights)
    calculate_per_token_loss: bool
    max_response_len: int            # tokens; Dr.GRPO's constant divisor (seq-mean-token-sum-norm)

    def num_optimizer_steps(self, num_samples: int) -> int:
        """Optimizer steps a rollout of `num_samples` kept samples takes (the LR schedule counts these)."""
        if self.num_steps_per_rollout is not None:
            return self.num_steps_per_rollout
        if self.global_batch_size is None:
            return 1
        return max(num_samples // self.global_batch_size, 1)

    def step_chunks(self, num_samples: int) -> list[list[int]]:
        """Sample indices of each optimizer step."""
        return optimizer_step_chunks(num_samples, self.global_batch_size, self.num_steps_per_rollout)

    def plan(self, lengths: list[int], world_size: int) -> RankPlan:
        """Rank split and, per rank, micro-batches as indices into `lengths` (the same on every rank)."""
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise ValueError("--max-tokens-per-gpu: auto budget not probed yet "
                             "(memory_probe.plan_trainer_memory, then RunConfig.with_max_tokens)")
        return rank_micro_batches(lengths, world_size, self.max_tokens_per_gpu if self.use_dynamic_batch_size else None,
                                  self.micro_batch_size)

    def loss_weights(self, samples: list[TrainSample]) -> list[torch.Tensor]:
        """Per-sample token weights [R] of one optimizer step (all ranks' samples) under --loss-agg-mode."""
        return step_loss_weights(samples, self.loss_agg_mode, self.calculate_per_token_loss, self.max_response_len)

    def metric_weights(self, samples: list[TrainSample]) -> list[torch.Tensor] | None:
        """Plain-mean weights [R] for the KL/entropy terms and metrics where they differ (Dr.GRPO), else None."""
        return step_metric_weights(samples, self.loss_agg_mode)
