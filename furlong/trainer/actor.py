"""The data-parallel trainer ("actor"): log-prob passes and optimizer steps (docs/design.md §2, §5).

Every rank gets ALL samples of the rollout and runs the same pure planning
functions on them, so the rank split, each rank's micro-batch plan, the common
micro-batch count (max over ranks), the global batch size and the global
count of loss tokens are known on every rank without any collective.

Per optimizer step:
  1. split the step's samples over ranks, token-balanced (split_across_ranks);
  2. plan this rank's micro-batches (dynamic: token budget; else fixed size),
     pad with 1-token dummy micro-batches of zero weight up to the max count
     over ranks, so that every rank runs the same FSDP collectives;
  3. per micro-batch: forward_packed -> chunked_log_probs -> loss -> backward.
     The loss weights carry the global aggregation (batching.py), and FSDP sums
     gradients over ranks (fsdp.py), so the result equals one big batch;
  4. clip the grad norm, optimizer step, scheduler step.

Log-prob reuse: with exactly one optimizer step per rollout the old policy is
the current one, so old log-probs = the training forward's, detached
(`--skip-actor-forward-only`, on by default exactly then; run/step.log_prob_passes
decides which passes run, train_step only trains). The model has no dropout, so
the two forwards would be identical.

The frozen reference model (for --use-kl-loss) is a copy of the initial
weights, sharded the same way, never trained.
"""
from __future__ import annotations

import copy
import math
import time
import warnings
from typing import Callable

import torch

from furlong.trainer.batching import (move_micro_batch, pack_micro_batch, padding_micro_batch, response_positions,
                                    response_slices, to_device)
from furlong.trainer.optimizer_step import finish_step
from furlong.trainer.fsdp import compile_enabled, micro_batch_sync, prepare_trainer_model
from furlong.trainer.no_grad_pass import gathered_forward
from furlong.trainer.logprobs import chunked_log_probs, keep_logits_budget
from furlong.algorithms.losses import LossMetrics, LossParams, rl_loss, sft_loss
from furlong.trainer.metrics import StepResult, TrainMetrics
from furlong.trainer.spec import ActorSpec
from furlong.trainer.optimizer import build_lr_scheduler, build_optimizer
from furlong.types import DistContext, MicroBatch, TrainSample


LOGPROB_CHUNK = 4096  # positions per logits chunk: [4096, V] fp32 is ~2.4 GB at V = 152k


def _rl(mb: MicroBatch, logp: torch.Tensor, ent: torch.Tensor | None, params: LossParams):
    return rl_loss(mb, logp, ent, params)


def _sft(mb: MicroBatch, logp: torch.Tensor, ent: torch.Tensor | None, params: LossParams):
    loss = sft_loss(mb, logp)
    m = LossMetrics.zeros(loss.device)
    m.loss = loss.detach().float()
    if ent is not None:
        m.entropy = (ent.detach() * mb.loss_weight).sum()
    return loss, m


# Actor(loss=...) -> micro-batch objective: (mb, log_probs, entropy, params) -> (loss, LossMetrics).
LOSSES: dict[str, Callable] = {"rl": _rl, "sft": _sft}


class Actor:
    def __init__(self, model: torch.nn.Module, spec: ActorSpec, ctx: DistContext, loss: str = "rl",
                 max_tokens_per_gpu: int | None = None):
        """`model`: the unsharded policy (any device/dtype; it is sharded in place, fp32 masters).
        `spec`: specs.actor_spec(cfg) for a run.

        max_tokens_per_gpu: the budget when --max-tokens-per-gpu is auto (memory_probe), or
        set `actor.max_tokens_per_gpu` after construction (the probe needs the sharded model).
        """
        if loss not in LOSSES:
            raise ValueError(f"Actor: unknown loss {loss!r} ({', '.join(LOSSES)})")
        self.spec, self.ctx = spec, ctx
        self.loss_name, self.loss_fn = loss, LOSSES[loss]
        ref = copy.deepcopy(model) if spec.use_ref_model else None
        self.model = prepare_trainer_model(model, ctx, spec.shard).train()
        self.ref_model = None
        if ref is not None:
            ref.requires_grad_(False)
            self.ref_model = prepare_trainer_model(ref, ctx, spec.shard).eval()
        self.optimizer = build_optimizer(self.model, spec.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, spec.optim, spec.total_steps)
        # under --max-tokens-per-gpu auto: the caller's stand-in budget (run set-up passes CPU_DEFAULT_TOKENS,
        # which the probe's trial steps need) until it sets memory_probe.probe_max_tokens(actor); None without one
        self.max_tokens_per_gpu = max_tokens_per_gpu if max_tokens_per_gpu is not None else spec.steps.max_tokens_per_gpu
        # bytes of LM-head logits a training forward keeps for its backward (logprobs.py); the memory
        # probe measures without them and counts this budget as fixed memory
        self.keep_logits_bytes = keep_logits_budget(ctx.device)

    # ------------------------------------------------------------------ planning

    def _plan_ranks(self, lengths: list[int]) -> tuple[list[list[int]], list[list[list[int]]]]:
        """Rank split and, per rank, micro-batches as indices into `lengths` (same on every rank)."""
        return self.spec.steps.plan(lengths, self.ctx.world_size, self.max_tokens_per_gpu)

    # ------------------------------------------------------------------ forward

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
                                      mb.targets.index_select(0, positions), self.spec.temperature,
                                      LOGPROB_CHUNK, with_entropy,
                                      compiled=compile_enabled(self.spec.shard.torch_compile, hidden.device),
                                      keep_logits_bytes=keep)
        spread = lambda x: torch.zeros(mb.num_tokens, dtype=x.dtype, device=x.device).index_copy(0, positions, x)  # noqa: E731
        return spread(logp), None if ent is None else spread(ent)

    def compute_log_probs(self, samples: list[TrainSample], which: str = "old") -> list[torch.Tensor]:
        """Response log-probs [R] (fp32, CPU) of every sample under the current ("old") or
        reference ("ref") model, on every rank (no_grad_pass.gathered_forward)."""
        models = {"old": self.model, "ref": self.ref_model}
        model = models.get(which)
        if model is None:
            raise ValueError(f"compute_log_probs: no {which!r} model (ref needs --use-kl-loss)")

        def forward(mb: MicroBatch, slices: list[tuple[int, int]]) -> torch.Tensor:
            positions = to_device(response_positions(slices), self.ctx.device)
            return self._log_probs(model, mb, positions, with_entropy=False)[0]
        return gathered_forward(model, samples, self._plan_ranks([s.num_tokens for s in samples]), self.ctx, forward)

    # ------------------------------------------------------------------ training

    def train_step(self, samples: list[TrainSample]) -> TrainMetrics:
        """All optimizer steps for one rollout's samples (identical list on every rank). It only trains:
        old and reference log-probs are on the samples already (run/step.py), old ones None meaning
        the training forward's own, detached (exact with one optimizer step)."""
        if not samples:
            raise ValueError("train_step: no samples")
        t0 = time.perf_counter()
        chunks = self.spec.steps.step_chunks(len(samples))
        if self.loss_name == "rl" and len(chunks) > 1 and samples[0].old_log_probs is None:
            raise ValueError("train_step: several optimizer steps per rollout need old log-probs from before the "
                             "first (run/step.py: log_prob_passes)")
        steps = [self._optimizer_step([samples[i] for i in idx]) for idx in chunks]
        n = len(steps)
        finite = [st for st in steps if st.finite] or steps
        mean = lambda name: float(sum(getattr(st.metrics, name) for st in steps)) / n  # noqa: E731
        return TrainMetrics(
            loss=mean("loss"), pg_loss=mean("pg_loss"), pg_clipfrac=mean("pg_clipfrac"), ppo_kl=mean("ppo_kl"),
            entropy=mean("entropy"), kl_loss=mean("kl_loss"),
            rollout_logprob_abs_diff=mean("rollout_logprob_abs_diff"),
            grad_norm=sum(st.grad_norm for st in finite) / len(finite), lr=steps[-1].lr, num_steps=n,
            num_skipped_steps=sum(not st.finite for st in steps),
            num_micro_batches=sum(st.num_micro_batches for st in steps),
            tokens_max_over_mean=max(st.tokens_max_over_mean for st in steps),
            num_tokens=sum(st.num_tokens for st in steps), seconds=time.perf_counter() - t0,
        )

    def _optimizer_step(self, samples: list[TrainSample]) -> "StepResult":
        ctx = self.ctx
        lengths = [s.num_tokens for s in samples]
        split, plans = self._plan_ranks(lengths)
        mine, num_mb = plans[ctx.rank], max(len(p) for p in plans)
        # global aggregation, known locally because every rank holds all of the step's samples
        weights = self.spec.steps.loss_weights(samples)
        has_old = samples[0].old_log_probs is not None
        has_ref = samples[0].ref_log_probs is not None
        # entropy is always reported; it carries gradient only with --entropy-coef
        with_entropy = True
        total = LossMetrics.zeros(ctx.device)
        self.optimizer.zero_grad(set_to_none=True)
        for k in range(num_mb):
            micro_batch_sync(self.model, k, num_mb, self.spec.shard.reshard_after_forward)
            mb = pack_micro_batch(samples, weights, mine[k]) if k < len(mine) else padding_micro_batch(has_old, has_ref)
            positions = to_device(response_positions(response_slices(mb, samples)), ctx.device)
            mb = move_micro_batch(mb, ctx.device)
            logp, ent = self._log_probs(self.model, mb, positions, with_entropy)
            if self.spec.loss.entropy_coef == 0 and ent is not None:
                ent = ent.detach()
            loss, metrics = self.loss_fn(mb, logp, ent, self.spec.loss)
            loss.backward()
            total = total + metrics
        host, norm, lr = finish_step(self.model, self.optimizer, self.scheduler, total.stacked(),
                                     self.spec.optim.clip_grad, ctx.world_size, "actor")
        rank_tokens = [sum(lengths[i] for i in idx) for idx in split]
        mean_tokens = sum(rank_tokens) / len(rank_tokens)
        return StepResult(
            metrics=LossMetrics(*(torch.tensor(v) for v in host)), grad_norm=norm, finite=math.isfinite(norm),
            lr=lr, num_micro_batches=num_mb, num_tokens=sum(lengths),
            tokens_max_over_mean=max(rank_tokens) / mean_tokens if mean_tokens > 0 else 1.0)
