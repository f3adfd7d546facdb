"""What the trainers (actor.py, critic.py) are built from: small typed specs, not the whole Config.

furlong/run/specs.py is the one place these are made from the flags. A trainer reads only its
spec, so a test or a bench builds one directly, and a change of plan (the bench's micro-batch
size 1 comparison) is a `dataclasses.replace` of the spec.

`StepSpec` is shared by actor and critic: both split a rollout's samples into the same
optimizer steps and micro-batches, so their gradients aggregate the same way (docs/design.md §5).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from furlong.trainer.batching import step_loss_weights
from furlong.trainer.planning import optimizer_step_chunks, rank_micro_batches

if TYPE_CHECKING:
    import torch

    from furlong.config import OptimConfig
    from furlong.algorithms.losses import LossParams
    from furlong.models.lora import LoraSpec
    from furlong.types import TrainSample


@dataclass(frozen=True)
class ShardSpec:
    """How a trainer's model is placed: FSDP2 with fp32 masters, compute in `dtype`."""
    dtype: str                       # --dtype: auto | bf16 | fp32 (fsdp.compute_dtype resolves it per device)
    torch_compile: str               # --torch-compile: auto (on CUDA) | on | off
    gradient_checkpointing: bool     # recompute decoder layers in backward
    # False: a layer's gathered weights stay from its first forward of an optimizer step to the step's
    # last backward (fsdp.micro_batch_sync); True: FSDP's default, gathered again in every backward
    reshard_after_forward: bool


@dataclass(frozen=True)
class StepSpec:
    """How one rollout's samples become optimizer steps, micro-batches and loss weights."""
    global_batch_size: int | None    # samples per optimizer step (None: all of the rollout's)
    num_steps_per_rollout: int | None   # wins over global_batch_size when set
    use_dynamic_batch_size: bool     # micro-batches packed by token count
    max_tokens_per_gpu: int | None   # token budget per micro-batch (None: 'auto', probed after build)
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

    def plan(self, lengths: list[int], world_size: int,
             max_tokens_per_gpu: int | None) -> tuple[list[list[int]], list[list[list[int]]]]:
        """Rank split and, per rank, micro-batches as indices into `lengths` (the same on every rank).
        `max_tokens_per_gpu`: the trainer's budget (the probed one under 'auto')."""
        if self.use_dynamic_batch_size and max_tokens_per_gpu is None:
            raise ValueError("--max-tokens-per-gpu: auto budget not probed yet "
                             "(set trainer.max_tokens_per_gpu = memory_probe.probe_max_tokens(actor))")
        return rank_micro_batches(lengths, world_size, max_tokens_per_gpu if self.use_dynamic_batch_size else None,
                                  self.micro_batch_size)

    def loss_weights(self, samples: list[TrainSample]) -> list[torch.Tensor]:
        """Per-sample token weights [R] of one optimizer step (all ranks' samples) under --loss-agg-mode."""
        return step_loss_weights(samples, self.loss_agg_mode, self.calculate_per_token_loss, self.max_response_len)


@dataclass(frozen=True)
class ActorSpec:
    shard: ShardSpec
    steps: StepSpec
    optim: OptimConfig
    loss: LossParams
    temperature: float               # log-probs are taken at the sampling temperature (as miles)
    skip_actor_forward_only: bool | None   # None: reuse the training forward's log-probs exactly when exact
    use_ref_model: bool              # keep a frozen copy of the initial weights (KL loss or KL in the reward)
    total_steps: int                 # optimizer steps of the LR schedule
    lora: LoraSpec | None = None     # adapters on a frozen base (--lora-rank >= 1); None: full-parameter


@dataclass(frozen=True)
class CriticSpec:
    shard: ShardSpec
    steps: StepSpec
    optim: OptimConfig               # the actor's with --critic-lr and --critic-lr-warmup-iters
    value_clip: float                # clip of new values around step 1's (value_loss.py)
    total_steps: int                 # optimizer steps of the LR schedule
    head_seed: int                   # seeds the fresh value head: the same on every rank and world size
