"""The policy trainer ("actor"): log-prob passes and optimizer steps (docs/design.md §2, §5).

The sharding, the rank split and micro-batch plan, the optimizer step and the no-grad pass are the
trainer base's (base.py), shared with the critic. The actor adds the policy's objective per
micro-batch: forward_packed -> chunked_log_probs (response positions only) -> loss (LOSSES: the RL
loss of losses.py, or SFT's cross-entropy).

Log-prob reuse: with exactly one optimizer step per rollout the old policy is
the current one, so old log-probs = the training forward's, detached
(`--skip-actor-forward-only`, on by default exactly then; run/step.log_prob_passes
decides which passes run, train_step only trains). The model has no dropout, so
the two forwards would be identical.

The frozen reference model (for --use-kl-loss) is a copy of the initial
weights (or --ref-load's: run/reference.py), sharded the same way, never trained;
--ref-update-interval copies the actor's weights into it (update_reference). With LoRA (cfg.lora) the base
weights are frozen and only the adapters train (models/lora.py): the reference
is the same model with its adapters switched off, no second copy.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from furlong.algorithms.custom_loss import Slices, custom_loss
from furlong.algorithms.losses import LossConfig, LossMetrics, rl_loss, sft_loss
from furlong.config import OptimConfig
from furlong.models.lora import LoraConfig, adapters_disabled, apply_lora
from furlong.models.lora_names import resolve_targets
from furlong.trainer.base import Trainer
from furlong.trainer.batching import move_micro_batch, response_positions, response_slices, to_device
from furlong.trainer.fsdp import compile_enabled, prepare_trainer_model
from furlong.trainer.logprobs import chunked_log_probs, keep_logits_budget
from furlong.trainer.metrics import TrainMetrics
from furlong.trainer.trainer_config import BatchingConfig, ShardConfig
from furlong.types import DistContext, MicroBatch, TrainSample


LOGPROB_CHUNK = 4096  # positions per logits chunk: [4096, V] fp32 is ~2.4 GB at V = 152k


def _rl(mb: MicroBatch, logp: torch.Tensor, ent: torch.Tensor | None, cfg: LossConfig, slices: Slices):
    return rl_loss(mb, logp, ent, cfg, slices)


def _sft(mb: MicroBatch, logp: torch.Tensor, ent: torch.Tensor | None, cfg: LossConfig, slices: Slices):
    loss = sft_loss(mb, logp)
    m = LossMetrics.zeros(loss.device)
    m.loss = loss.detach().float()
    if ent is not None:
        m.entropy = (ent.detach() * mb.loss_weight).sum()
    return loss, m


# Actor(loss=...) -> micro-batch objective: (mb, log_probs, entropy, loss config, response slices) -> (loss,
# LossMetrics). "custom" is --loss-type custom_loss: the user's function, loaded into LossConfig.user.
LOSSES: dict[str, Callable] = {"rl": _rl, "sft": _sft, "custom": custom_loss}


def reference_shard(cfg: Actor.Config) -> ShardConfig:
    """The reference's placement: the actor's, or offloaded to the CPU (--ref-placement). Offloaded, its
    layers stay gathered from their first micro-batch to the end of the pass (no_grad_pass reshards
    them), so a pass copies each weight to the GPU once rather than once per micro-batch."""
    if not cfg.ref_on_cpu:   # resident, even beside an offloaded actor (--ref-placement gpu)
        return dataclasses.replace(cfg.shard, cpu_offload=False)
    return dataclasses.replace(cfg.shard, cpu_offload=True, reshard_after_forward=False,
                               gradient_checkpointing=False)


class Actor(Trainer):
    @dataclass(frozen=True)
    class Config:
        shard: ShardConfig
        optim: OptimConfig
        loss: LossConfig
        temperature: float           # log-probs are taken at the sampling temperature (as miles)
        use_ref_model: bool          # keep a frozen copy of the initial weights (KL loss or KL in the reward)
        total_steps: int             # optimizer steps of the LR schedule
        lora: LoraConfig | None = None   # adapters on a frozen base (--lora-rank >= 1); None: full-parameter
        # the reference's bf16 shards in (pinned) CPU memory, copied in once per pass (run/reference.py)
        ref_on_cpu: bool = False

    def __init__(self, model: torch.nn.Module, cfg: Actor.Config, ctx: DistContext, loss: str = "rl",
                 ref_model: torch.nn.Module | None = None):
        """`model`: the unsharded policy (any device/dtype; it is sharded in place, fp32 masters).
        `cfg`: config_map.actor_config(flags) for a run. `ref_model`: the unsharded reference when it is
        not the initial weights (--ref-load, a resumed --ref-update-interval; run/reference.py)."""
        if loss not in LOSSES:
            raise ValueError(f"Actor: unknown loss {loss!r} ({', '.join(LOSSES)})")
        if cfg.lora is not None:   # before sharding (Trainer.__init__): FSDP shards the adapters with their layers
            apply_lora(model, cfg.lora, resolve_targets(model, cfg.lora.target_modules))
        ref = None
        if cfg.use_ref_model and cfg.lora is None:
            ref = copy.deepcopy(model) if ref_model is None else ref_model
        super().__init__(model, cfg.shard, cfg.optim, cfg.total_steps, ctx, "actor")
        self.cfg = cfg
        self.loss_name, self.loss_fn = loss, LOSSES[loss]
        self.ref_model = None
        if ref is not None:
            ref.requires_grad_(False)
            self.ref_model = prepare_trainer_model(ref, ctx, reference_shard(cfg)).eval()
        # bytes of LM-head logits a training forward keeps for its backward (logprobs.py); the memory
        # probe measures without them and counts this budget as fixed memory
        self.keep_logits_bytes = keep_logits_budget(ctx.device)

    def _log_probs(self, model: torch.nn.Module, mb: MicroBatch, positions: torch.Tensor, with_entropy: bool):
        """Log-probs (and entropy) [T] of mb's targets; only `positions` (the response tokens'
        predicting positions, [R_total] on the device) go through the LM head: prompt positions
        carry no loss, and skipping them saves their share of the largest matmul. Other
        positions read 0."""
        with warnings.catch_warnings():
            # FSDP2 warns that forward_packed returns a view (row 0 of [1, T, H]); nothing here
            # modifies it in place, which is what the warning is about
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
            hidden = model.forward_packed(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
        weight = model.output_weight  # the root stays unsharded after forward (fsdp.py)
        # a backward follows only with grad enabled: only then are the forward's logits worth keeping
        keep = self.keep_logits_bytes if torch.is_grad_enabled() else 0
        logp, ent = chunked_log_probs(hidden.index_select(0, positions), weight.to(hidden.dtype),
                                      mb.targets.index_select(0, positions), self.cfg.temperature,
                                      LOGPROB_CHUNK, with_entropy,
                                      compiled=compile_enabled(self.cfg.shard.torch_compile, hidden.device),
                                      keep_logits_bytes=keep)
        spread = lambda x: torch.zeros(mb.num_tokens, dtype=x.dtype, device=x.device).index_copy(0, positions, x)  # noqa: E731
        return spread(logp), None if ent is None else spread(ent)

    def compute_log_probs(self, samples: list[TrainSample], steps: BatchingConfig,
                          which: str = "old") -> list[torch.Tensor]:
        """Response log-probs [R] (fp32, CPU) of every sample under the current ("old") or
        reference ("ref") model, on every rank (no_grad_pass.gathered_forward). With LoRA the
        reference is the base: the actor's own model with its adapters off."""
        lora_ref = self.model if self.cfg.lora is not None and self.cfg.use_ref_model else None
        models = {"old": self.model, "ref": self.ref_model if self.ref_model is not None else lora_ref}
        model = models.get(which)
        if model is None:
            raise ValueError(f"compute_log_probs: no {which!r} model (ref needs --use-kl-loss)")

        def forward(mb: MicroBatch, slices: list[tuple[int, int]]) -> torch.Tensor:
            positions = to_device(response_positions(slices), self.ctx.device)
            return self._log_probs(model, mb, positions, with_entropy=False)[0]
        # the reference is the base model: LoRA's adapters off (a no-op on a full-parameter reference copy)
        with adapters_disabled(model) if which == "ref" else contextlib.nullcontext():
            return self._gathered(model, samples, steps, forward)

    def train_step(self, samples: list[TrainSample], steps: BatchingConfig) -> TrainMetrics:
        """All optimizer steps for one rollout's samples (identical list on every rank). It only trains:
        old and reference log-probs are on the samples already (run/step.py), old ones None meaning
        the training forward's own, detached (exact with one optimizer step)."""
        t0 = time.perf_counter()
        if self.loss_name != "sft" and steps.num_optimizer_steps(len(samples)) > 1 and samples[0].old_log_probs is None:
            raise ValueError("train_step: several optimizer steps per rollout need old log-probs from before the "
                             "first (run/step.py: log_prob_passes)")
        results = self._optimizer_steps(samples, steps, self._micro_loss, LossMetrics)
        return TrainMetrics.of(results, time.perf_counter() - t0)

    def _micro_loss(self, mb: MicroBatch, samples: list[TrainSample]) -> tuple[torch.Tensor, LossMetrics]:
        slices = response_slices(mb, samples)
        positions = to_device(response_positions(slices), self.ctx.device)
        mb = move_micro_batch(mb, self.ctx.device)
        # entropy is always reported; it carries gradient only with --entropy-coef
        logp, ent = self._log_probs(self.model, mb, positions, with_entropy=True)
        if self.cfg.loss.entropy_coef == 0 and ent is not None:
            ent = ent.detach()
        return self.loss_fn(mb, logp, ent, self.cfg.loss, slices)

    @torch.no_grad()
    def update_reference(self) -> None:
        """--ref-update-interval: the reference takes the actor's current weights. Both are sharded alike
        (same model, same mesh; only their placement may differ: reference_shard), so each rank copies its
        own shards: no gather."""
        for ref, p in zip(self.ref_model.parameters(), self.model.parameters()):
            # local shards: an offloaded reference's sit in CPU memory, the actor's on the GPU
            ref.to_local().copy_(p.to_local())
