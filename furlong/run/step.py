"""One RL step as a list of stages (docs/design.md §2), each a line of `rl_step` with its own timer.

    rollout          generate, reward and filter, streamed per group (run/rollout_step.py picks which
                     rollout: engine requests, a custom generate or rollout function): perf/rollout_time
                     from the rollout's own clock, of which perf/reward_time in the reward functions
    shaping          kept groups -> TrainSamples and shaped rewards [G, n] (DAPO's overlong penalty)
    old_log_probs    from the engine, a no-grad trainer forward, or left to the training forward
    ref_log_probs    the frozen reference model's, when a KL term needs them
    values           the critic's (ppo)
    advantages       the estimator of --advantage-estimator, then whitening (algorithms/advantages.py)
    critic_train     ppo: the critic first, on the values GAE used (miles' order)
    actor_train      except in the first --num-critic-only-steps rollouts (--reset-optimizer-states: the
                     trainers' optimizer state zeroed first)
    update_weights   the new weights into the engine, in place
    ref_update       --ref-update-interval N: after every N-th rollout the reference takes the actor's weights

Each stage's wall time is logged as `perf/<stage>_time`; `perf/log_probs_time` is old + ref (the
name miles' dashboards read). Eval, the metrics line and the checkpoint follow in loop.py.

Which log-prob passes run is decided once per run (`log_prob_passes`), from the flags and the
optimizer steps a rollout takes; the trainers only compute what they are asked for and train.
Every rank holds the whole batch here, so batch statistics (whitening) are global without a collective.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, TypeVar

import torch

from furlong.algorithms.advantages import AdvantageConfig, AdvantageInputs, compute_advantages
from furlong.algorithms.losses import kl_penalty
from furlong.algorithms.mismatch import mismatch_metrics
from furlong.algorithms.shaping import ShapingConfig, shaped_rewards
from furlong.launch.failure import Position
from furlong.rollout.rollout import RolloutBatch
from furlong.run.debug_data import save_train_data
from furlong.run.reward_metrics import rollout_reward_logs
from furlong.run.reward_post_process import RewardPostProcess
from furlong.run.rollout_step import rollout_step
from furlong.trainer.metrics import TrainMetrics
from furlong.trainer.trainer_config import BatchingConfig
from furlong.trainer.weight_sync import sync_weights
from furlong.types import Group, TrainSample

if TYPE_CHECKING:
    from furlong.config_map import RunConfig
    from furlong.engine import Engine
    from furlong.run.setup import RunParts
    from furlong.trainer.actor import Actor
    from furlong.trainer.critic import Critic

T = TypeVar("T")
OldSource = Literal["engine", "forward", "training"]


@dataclass(frozen=True)
class LogProbPasses:
    """Where a step's old and reference log-probs come from (decided once per run)."""
    old: OldSource     # engine: the rollout's; forward: a no-grad trainer pass; training: the training forward's
    ref: bool          # a reference-model pass (KL loss, or KL in the reward)


def log_prob_passes(use_rollout_logprobs: bool, use_kl_loss: bool, kl_coef: float,
                    skip_actor_forward_only: bool | None, num_optimizer_steps: int) -> LogProbPasses:
    """The log-prob passes a step needs. Old log-probs come from the training forward only when that is
    exact (one optimizer step per rollout: the policy has not moved yet) or --skip-actor-forward-only
    says so, and not when the reward's KL penalty needs them before training (--kl-coef)."""
    kl_in_reward = kl_coef > 0
    reuse = num_optimizer_steps == 1 if skip_actor_forward_only is None else skip_actor_forward_only
    if use_rollout_logprobs:
        old: OldSource = "engine"
    elif kl_in_reward or not reuse:
        old = "forward"
    else:
        old = "training"
    return LogProbPasses(old=old, ref=use_kl_loss or kl_in_reward)


class StageClock:
    """Wall-clock seconds of a step's stages: `clock.run("x", fn, ...)` records `perf/x_time`."""

    def __init__(self, position: Position | None = None, rollout_id: int | None = None) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.current = "rollout"          # the stage last entered (an out-of-memory line names it)
        self.position = position          # told each stage entered (a lost rank's line names it)
        self.rollout_id = rollout_id

    def where(self, name: str):
        """Mark the stage for the failure report only (no timer)."""
        return self.position.stage(name, self.rollout_id) if self.position is not None else nullcontext()

    @contextmanager
    def stage(self, name: str):
        t = time.perf_counter()
        self.current = name
        try:
            with self.where(name):
                yield
        finally:
            key = f"perf/{name}_time"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t

    def run(self, name: str, fn: Callable[..., T], *args) -> T:
        with self.stage(name):
            return fn(*args)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


# ------------------------------------------------------------------------------------------ stages

def train_samples(groups: list[Group], shaping: ShapingConfig,
                  post_process: RewardPostProcess | None = None) -> tuple[list[TrainSample], torch.Tensor]:
    """Kept groups -> TrainSamples (advantages still 0) and shaped rewards [G, n]. A multi-turn sample's
    loss mask (0 on tool/environment tokens) goes with it: the loss weights, token counts, KL and entropy
    terms all read it (trainer/batching.py, algorithms/losses.py). `post_process`: the user's rewards in
    place of the samples' own (--custom-reward-post-process-path)."""
    samples = [TrainSample(token_ids=torch.tensor(s.prompt.token_ids + s.response_ids, dtype=torch.long),
                           num_prompt_tokens=len(s.prompt.token_ids), advantages=torch.zeros(len(s.response_ids)),
                           rollout_log_probs=torch.tensor(s.rollout_log_probs, dtype=torch.float32),
                           loss_mask=None if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32))
               for g in groups for s in g.samples]
    rewards = torch.tensor([[float(s.reward) for s in g.samples] for g in groups], dtype=torch.float32)
    if post_process is not None and groups:
        rewards = torch.tensor(post_process([s for g in groups for s in g.samples]),
                               dtype=torch.float32).reshape(rewards.shape)
    lens = [[len(s.response_ids) for s in g.samples] for g in groups]
    return samples, shaped_rewards(rewards, lens, shaping)


def old_log_probs(samples: list[TrainSample], actor: Actor, steps: BatchingConfig, source: OldSource) -> None:
    """Set each sample's old_log_probs [R] (left None for "training": the training forward's, detached)."""
    if source == "engine":
        for s in samples:
            s.old_log_probs = s.rollout_log_probs
    elif source == "forward":
        for s, lp in zip(samples, actor.compute_log_probs(samples, steps, "old")):
            s.old_log_probs = lp


def ref_log_probs(samples: list[TrainSample], actor: Actor, steps: BatchingConfig, needed: bool) -> None:
    """Set each sample's ref_log_probs [R] under the frozen reference model, when a KL term needs them."""
    if needed:
        for s, lp in zip(samples, actor.compute_log_probs(samples, steps, "ref")):
            s.ref_log_probs = lp


def mismatch_step(samples: list[TrainSample], actor: Actor, steps: BatchingConfig, source: OldSource) -> dict[str, float]:
    """--get-mismatch-metrics (algorithms/mismatch.py) as train/*: the trainer's log-probs are the old ones
    when a trainer pass made them, else one more no-grad pass (engine old log-probs, as miles does)."""
    trainer = ([s.old_log_probs for s in samples] if source == "forward"
               else actor.compute_log_probs(samples, steps, "old"))
    masks = [torch.ones(s.num_response_tokens) if s.loss_mask is None else s.loss_mask for s in samples]
    m = mismatch_metrics(trainer, [s.rollout_log_probs for s in samples], masks, steps.calculate_per_token_loss)
    return {f"train/{k}": v for k, v in m.items()}


def values(samples: list[TrainSample], critic: Critic, steps: BatchingConfig) -> None:
    """Set each sample's values [R] under the current critic (ppo)."""
    for s, v in zip(samples, critic.compute_values(samples, steps)):
        s.values = v


def advantages(samples: list[TrainSample], rewards: torch.Tensor, cfg: AdvantageConfig) -> None:
    """Set advantages [R] (and, with values, the GAE returns [R] the critic trains on)."""
    # tool/environment tokens (loss mask 0) take no part in whitening, returns or the KL penalty's sums
    masks = [torch.ones(s.num_response_tokens) if s.loss_mask is None else s.loss_mask for s in samples]
    kl = None
    if cfg.kl_coef > 0:   # a KL penalty folded into the token rewards, from the old and reference log-probs
        kl = [kl_penalty(s.old_log_probs, s.ref_log_probs, cfg.kl_type) for s in samples]
    has_values = bool(samples) and samples[0].values is not None
    vals = [s.values for s in samples] if has_values else None
    adv, ret = compute_advantages(AdvantageInputs(rewards=rewards, response_masks=masks, kl=kl, values=vals), cfg)
    for s, a, r in zip(samples, adv, ret):
        s.advantages = a
        if has_values:
            s.returns = r


def releases_engine_weights(offload_weights: bool, cfg: RunConfig, rollout_id: int) -> bool:
    """Whether this step frees the engine's weights after its rollout: only where the actor's step ends
    with a weight update, which writes them all again (a critic-only warm-up rollout has none; replayed
    rollouts, --debug-train-only, never use the engine)."""
    return offload_weights and not cfg.debug.train_only and rollout_id >= cfg.num_critic_only_steps


def update_engine_weights(actor_model: torch.nn.Module, engine: Engine, bucket_bytes: int) -> int:
    """The weight update: memory for the engine's weights again if the step released them, then every
    weight written from the trainer's (weight_sync.py); -> bytes written."""
    engine.restore_weights()
    return sync_weights(actor_model, engine.model, bucket_bytes)


# ------------------------------------------------------------------------------------------ the step

@dataclass
class StepOutput:
    batch: RolloutBatch
    samples: list[TrainSample]
    metrics: dict[str, float]        # rollout/*, critic/*, train/* (perf/* are the clock's)
    train: TrainMetrics | None       # the actor's step (None in a critic-only warm-up rollout)


def rl_step(parts: RunParts, rollout_id: int, clock: StageClock) -> StepOutput:
    """Rollout `rollout_id` through the weight sync, stage by stage (module docstring)."""
    cfg, actor, critic = parts.config, parts.actor, parts.critic
    with clock.where("rollout"):
        batch = rollout_step(parts, cfg.rollout, rollout_id)         # timed by its own clock: perf/rollout_time
    metrics = {**batch.metrics.as_log(),   # --log-passrate, --log-reward-category (run/reward_metrics.py)
               **rollout_reward_logs(batch.samples, cfg.rollout.n_samples_per_prompt, cfg.reward_logs)}
    if cfg.debug.rollout_only:   # --debug-rollout-only: the step ends with its rollout (run/debug_data.py)
        return StepOutput(batch=batch, samples=[], metrics=metrics, train=None)
    if releases_engine_weights(parts.engine.cfg.offload_weights, cfg, rollout_id):
        parts.engine.release_weights()   # --offload-rollout-level weight: update_engine_weights takes them back
    post = parts.functions.reward_post_process if parts.functions is not None else None
    samples, rewards = clock.run("shaping", train_samples, batch.groups, cfg.shaping, post)
    clock.run("old_log_probs", old_log_probs, samples, actor, cfg.steps, cfg.passes.old)
    if cfg.mismatch_metrics:
        metrics.update(clock.run("mismatch_metrics", mismatch_step, samples, actor, cfg.steps, cfg.passes.old))
    clock.run("ref_log_probs", ref_log_probs, samples, actor, cfg.steps, cfg.passes.ref)
    if critic is not None:
        clock.run("values", values, samples, critic, cfg.steps)
    clock.run("advantages", advantages, samples, rewards, cfg.advantages)
    if cfg.debug.save_train_data is not None:
        save_train_data(cfg.debug.save_train_data, rollout_id, parts.ctx.rank, samples)
    if critic is not None:
        if cfg.reset_optimizer_states:   # miles (Megatron): fresh moments at the start of every rollout's training
            critic.reset_optimizer_state()
        metrics.update(clock.run("critic_train", critic.train_step, samples, cfg.steps).to_log())
    train = None
    if rollout_id >= cfg.num_critic_only_steps:   # --num-critic-only-steps: the actor stays frozen until then
        if cfg.reset_optimizer_states:
            actor.reset_optimizer_state()
        train = clock.run("actor_train", actor.train_step, samples, cfg.steps)
        if not cfg.debug.train_only:   # replayed rollouts: the engine generates nothing (miles skips it too)
            clock.run("update_weights", update_engine_weights, actor.model, parts.engine, cfg.update_weight_buffer_size)
        metrics.update({k: v for k, v in train.to_log().items() if k != "train/ois" or cfg.log_ois})
    n = cfg.ref_update_interval
    if n is not None and train is not None and actor.ref_model is not None and (rollout_id + 1) % n == 0:
        # miles: at the end of the actor's train step
        clock.run("ref_update", actor.update_reference)
    return StepOutput(batch=batch, samples=samples, metrics=metrics, train=train)
