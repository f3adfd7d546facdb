"""Flags -> component specs, in one place (docs/design.md §4).

Config (config.py) is grouped by miles' flag names; components are not. Each component takes
a small typed spec of what it reads, and this module is the only place that maps flags onto
those specs, with the flags' fallbacks (eval settings default to the rollout's, --eps-clip-high
to --eps-clip, the critic's lr to --lr) resolved here once. Below the run set-up, no
component imports Config: the trainers, the rollout, eval, the sample builder and the
checkpoint helpers are testable from their specs alone.
"""
from __future__ import annotations

import dataclasses

from furlong.config import Config
from furlong.engine.sampling import SamplingParams
from furlong.rollout.eval import EvalSpec
from furlong.rollout.rollout import RolloutSpec
from furlong.algorithms.advantages import AdvantageConfig
from furlong.algorithms.shaping import ShapingConfig
from furlong.algorithms.losses import LossParams
from furlong.checkpoint.run import CheckpointPaths
from furlong.run.step import LogProbPasses, StepSettings, log_prob_passes
from furlong.trainer.spec import ActorSpec, CriticSpec, ShardSpec, StepSpec


def shard_spec(cfg: Config) -> ShardSpec:
    p = cfg.parallel
    return ShardSpec(dtype=p.dtype, torch_compile=p.torch_compile,
                     gradient_checkpointing=cfg.batch.gradient_checkpointing,
                     reshard_after_forward=p.fsdp_reshard_after_forward)


def step_spec(cfg: Config) -> StepSpec:
    b, a = cfg.batch, cfg.algo
    return StepSpec(global_batch_size=b.global_batch_size, num_steps_per_rollout=b.num_steps_per_rollout,
                    use_dynamic_batch_size=b.use_dynamic_batch_size, max_tokens_per_gpu=cfg.max_tokens_per_gpu,
                    micro_batch_size=b.micro_batch_size, loss_agg_mode=a.loss_agg_mode,
                    calculate_per_token_loss=a.calculate_per_token_loss,
                    max_response_len=cfg.rollout.rollout_max_response_len)


def loss_params(cfg: Config) -> LossParams:
    a = cfg.algo
    return LossParams(eps_clip=a.eps_clip, eps_clip_high=cfg.eps_clip_high, eps_clip_c=a.eps_clip_c,
                      use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type,
                      entropy_coef=a.entropy_coef, use_tis=a.use_tis, tis_clip=a.tis_clip,
                      tis_clip_low=a.tis_clip_low, use_unbiased_kl=a.use_unbiased_kl,
                      sequence_ratio=a.advantage_estimator == "gspo")


def _run_steps(cfg: Config, num_rollouts: int) -> int:
    """Optimizer steps of `num_rollouts` full rollouts (the LR schedule's length)."""
    kept = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    return max(num_rollouts, 1) * step_spec(cfg).num_optimizer_steps(kept)


def actor_spec(cfg: Config, total_steps: int | None = None) -> ActorSpec:
    """total_steps: the LR schedule's optimizer steps; by default the run's, less the rollouts a
    ppo actor sits out (--num-critic-only-steps) so that a decaying LR still reaches --min-lr."""
    a = cfg.algo
    if total_steps is None:
        total_steps = _run_steps(cfg, cfg.rollout.num_rollout - a.num_critic_only_steps)
    return ActorSpec(shard=shard_spec(cfg), steps=step_spec(cfg), optim=cfg.optim, loss=loss_params(cfg),
                     temperature=cfg.rollout.rollout_temperature, skip_actor_forward_only=a.skip_actor_forward_only,
                     use_ref_model=a.use_kl_loss or a.kl_coef > 0, total_steps=total_steps)


def critic_spec(cfg: Config, total_steps: int | None = None) -> CriticSpec:
    """The critic's optimizer is the actor's (--optimizer, betas, weight decay, --clip-grad, decay
    style) with --critic-lr (default --lr) and --critic-lr-warmup-iters swapped in, as miles does."""
    a = cfg.algo
    optim = dataclasses.replace(cfg.optim, lr=cfg.optim.lr if a.critic_lr is None else a.critic_lr,
                                lr_warmup_iters=a.critic_lr_warmup_iters)
    return CriticSpec(shard=shard_spec(cfg), steps=step_spec(cfg), optim=optim, value_clip=a.value_clip,
                      total_steps=_run_steps(cfg, cfg.rollout.num_rollout) if total_steps is None else total_steps,
                      head_seed=cfg.parallel.seed)


def advantage_config(cfg: Config) -> AdvantageConfig:
    a = cfg.algo
    # miles requires whitening for the reinforce_plus_plus family (its returns are not centred);
    # furlong applies it for them whether or not --normalize-advantages is given
    whiten = a.normalize_advantages or a.advantage_estimator.startswith("reinforce_plus_plus")
    return AdvantageConfig(estimator=a.advantage_estimator, whiten=whiten, kl_type=a.kl_loss_type,
                           normalize_std=not a.disable_grpo_std_normalization,
                           normalize_rewards=not a.disable_rewards_normalization, kl_coef=a.kl_coef,
                           gamma=a.gamma, lambd=a.lambd)


def shaping_config(cfg: Config) -> ShapingConfig:
    a = cfg.algo
    return ShapingConfig(overlong_buffer_len=a.overlong_buffer_len, overlong_penalty_factor=a.overlong_penalty_factor,
                         max_response_len=cfg.rollout.rollout_max_response_len)


def passes(cfg: Config) -> LogProbPasses:
    a = cfg.algo
    kept = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt   # a rollout keeps exactly these
    return log_prob_passes(a.use_rollout_logprobs, a.use_kl_loss, a.kl_coef, a.skip_actor_forward_only,
                           step_spec(cfg).num_optimizer_steps(kept))


def step_settings(cfg: Config) -> StepSettings:
    return StepSettings(rollout=rollout_spec(cfg), shaping=shaping_config(cfg), advantages=advantage_config(cfg),
                        passes=passes(cfg), num_critic_only_steps=cfg.algo.num_critic_only_steps,
                        update_weight_buffer_size=cfg.batch.update_weight_buffer_size)


def rollout_spec(cfg: Config) -> RolloutSpec:
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.rollout_temperature, top_p=r.rollout_top_p, top_k=r.rollout_top_k,
                              max_new_tokens=r.rollout_max_response_len, stop=list(r.rollout_stop),
                              stop_token_ids=list(r.rollout_stop_token_ids))
    return RolloutSpec(rollout_batch_size=r.rollout_batch_size, n_samples_per_prompt=r.n_samples_per_prompt,
                       over_sampling_batch_size=cfg.over_sampling_batch_size, sampling=sampling,
                       seed=cfg.rollout_seed, max_context_len=r.rollout_max_context_len)


def eval_spec(cfg: Config) -> EvalSpec:
    e, r = cfg.eval_sampling(), cfg.rollout
    sampling = SamplingParams(temperature=e.temperature, top_p=e.top_p, top_k=e.top_k,
                              max_new_tokens=e.max_new_tokens, stop=list(r.rollout_stop),
                              stop_token_ids=list(r.rollout_stop_token_ids), seed=cfg.rollout_seed)
    return EvalSpec(sampling=sampling, n_samples_per_prompt=cfg.eval.n_samples_per_eval_prompt)


def checkpoint_paths(cfg: Config) -> CheckpointPaths:
    """The actor's --save/--load and the critic's, by default beside them + "_critic" (miles' default;
    critic_checkpoint.py says why the critic's resume does not fall back to --load itself)."""
    c, a = cfg.ckpt, cfg.algo
    sibling = lambda path: None if path is None else path.rstrip("/") + "_critic"  # noqa: E731
    return CheckpointPaths(save=c.save, load=c.load,
                           critic_save=a.critic_save if a.critic_save is not None else sibling(c.save),
                           critic_load=a.critic_load if a.critic_load is not None else sibling(c.load),
                           source=cfg.data.hf_checkpoint)
