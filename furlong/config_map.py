"""Flags -> the components' own configs, in one place (docs/design.md §4).

config.py defines each flag once, grouped by miles' names; the components are not grouped that
way: each owns a small config of what it reads (Actor.Config, Critic.Config, BatchingConfig,
RolloutConfig, EvalConfig, EngineConfig, CheckpointConfig, AdvantageConfig, ...). This module is
the only mapping from the flags onto them, and every fallback is resolved here, once: eval
sampling defaults to the rollout's, --eps-clip-high to --eps-clip, --over-sampling-batch-size to
--rollout-batch-size, the critic's lr to --lr and its checkpoint directories to --save/--load +
"_critic", whitening is on for the reinforce_plus_plus family, and --max-tokens-per-gpu 'auto' is
None until the memory probe's budget replaces it (RunConfig.with_max_tokens). Validation is
config_checks.validate's, before this runs. Below the run set-up no component reads the flags: the
trainers, rollout, eval and checkpoint helpers are testable from their configs alone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from furlong.algorithms.advantages import AdvantageConfig
from furlong.algorithms.losses import LossConfig
from furlong.algorithms.shaping import ShapingConfig
from furlong.checkpoint.run import CheckpointConfig
from furlong.config import RUN_DIR_SAMPLES, Config
from furlong.config_checks import chat_template_kwargs
from furlong.config_train_flags import num_rollouts
from furlong.engine.engine import EngineConfig
from furlong.engine.sampling import SamplingParams
from furlong.models.lora import LoraConfig
from furlong.models.lora_names import parse_target_modules
from furlong.rollout.custom_generate import GenerateConfig
from furlong.rollout.eval import EvalConfig
from furlong.rollout.rollout import RolloutConfig
from furlong.run.debug_data import DebugConfig, debug_config
from furlong.run.reward_metrics import RewardLogConfig
from furlong.run.step import LogProbPasses, log_prob_passes
from furlong.run.user_functions import load_loss_functions
from furlong.trainer.actor import Actor
from furlong.trainer.critic import Critic
from furlong.trainer.trainer_config import BatchingConfig, ShardConfig


@dataclass(frozen=True)
class RunConfig:
    """Everything the RL loop and its stages read, made once per run (run_config)."""
    num_rollout: int                 # rollout ids 0 .. num_rollout - 1
    rollout: RolloutConfig
    eval: EvalConfig
    steps: BatchingConfig            # actor and critic alike
    shaping: ShapingConfig
    advantages: AdvantageConfig
    passes: LogProbPasses            # decided once: the flags and the optimizer steps per rollout
    checkpoint: CheckpointConfig
    num_critic_only_steps: int       # ppo: the first rollouts train only the critic
    update_weight_buffer_size: int   # bytes per weight-sync bucket
    save_debug_rollout_data: bool    # bare flag: each training rollout's samples to samples/ (a template: debug)
    ci_metric_key: str | None        # --ci-test: the eval metric that must reach ci_threshold (None: no check)
    ci_threshold: float | None
    ci_check_kl: bool                # --ci-test: the first actor step's ppo_kl must be ~0
    max_nonfinite_skips: int         # stop after this many optimizer steps in a row skipped (0: never)
    generate: GenerateConfig = GenerateConfig(max_context_len=None)   # custom generate/rollout functions
    debug: DebugConfig = DebugConfig()                                # miles' debug modes (run/debug_data.py)
    reward_logs: RewardLogConfig = RewardLogConfig()                  # --log-passrate, --log-reward-category
    mismatch_metrics: bool = False                                    # --get-mismatch-metrics
    log_ois: bool = False                    # train/ois: with --get-mismatch-metrics or --use-tis (as miles)
    ref_update_interval: int | None = None   # the reference takes the actor's weights every N rollouts
    reset_optimizer_states: bool = False     # zero the trainers' optimizer state before each rollout's training

    def with_max_tokens(self, max_tokens_per_gpu: int) -> RunConfig:
        """This config with the micro-batch token budget the memory probe chose ('auto')."""
        return dataclasses.replace(self, steps=dataclasses.replace(self.steps, max_tokens_per_gpu=max_tokens_per_gpu))


def max_tokens_is_auto(cfg: Config) -> bool:
    return cfg.batch.max_tokens_per_gpu == "auto"


def shard_config(cfg: Config) -> ShardConfig:
    p = cfg.parallel
    return ShardConfig(dtype=p.dtype, torch_compile=p.torch_compile,
                       gradient_checkpointing=cfg.batch.gradient_checkpointing,
                       reshard_after_forward=p.fsdp_reshard_after_forward, cpu_offload=p.fsdp_cpu_offload,
                       optimizer_offload=p.optimizer_cpu_offload)


def batching_config(cfg: Config) -> BatchingConfig:
    b, a = cfg.batch, cfg.algo
    budget = None if b.max_tokens_per_gpu in (None, "auto") else int(b.max_tokens_per_gpu)
    return BatchingConfig(global_batch_size=b.global_batch_size, num_steps_per_rollout=b.num_steps_per_rollout,
                          use_dynamic_batch_size=b.use_dynamic_batch_size, max_tokens_per_gpu=budget,
                          micro_batch_size=b.micro_batch_size, loss_agg_mode=a.loss_agg_mode,
                          calculate_per_token_loss=a.calculate_per_token_loss,
                          max_response_len=cfg.rollout.rollout_max_response_len)


def loss_config(cfg: Config) -> LossConfig:
    a = cfg.algo
    return LossConfig(eps_clip=a.eps_clip, eps_clip_high=a.eps_clip if a.eps_clip_high is None else a.eps_clip_high,
                      eps_clip_c=a.eps_clip_c, use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef,
                      kl_loss_type=a.kl_loss_type, entropy_coef=a.entropy_coef, use_tis=a.use_tis,
                      tis_clip=a.tis_clip, tis_clip_low=a.tis_clip_low, use_unbiased_kl=a.use_unbiased_kl,
                      sequence_ratio=a.advantage_estimator == "gspo", user=load_loss_functions(cfg))


def _kept_samples(cfg: Config) -> int:
    return cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt   # a rollout keeps exactly these


def _run_steps(cfg: Config, num_rollouts: int) -> int:
    """Optimizer steps of `num_rollouts` full rollouts (the LR schedule's length)."""
    return max(num_rollouts, 1) * batching_config(cfg).num_optimizer_steps(_kept_samples(cfg))


def actor_config(cfg: Config, total_steps: int | None = None) -> Actor.Config:
    """total_steps: the LR schedule's optimizer steps; by default the run's, less the rollouts a
    ppo actor sits out (--num-critic-only-steps) so that a decaying LR still reaches --min-lr."""
    a = cfg.algo
    if total_steps is None:
        total_steps = _run_steps(cfg, num_rollouts(cfg) - a.num_critic_only_steps)
    return Actor.Config(shard=shard_config(cfg), optim=cfg.optim, loss=loss_config(cfg),
                        temperature=cfg.rollout.rollout_temperature, use_ref_model=a.use_kl_loss or a.kl_coef > 0,
                        total_steps=total_steps, lora=lora_config(cfg),
                        # "auto" needs the model's size and the GPU: run set-up resolves it (run/reference.py)
                        ref_on_cpu=cfg.ref.ref_placement == "cpu")


def lora_config(cfg: Config) -> LoraConfig | None:
    """The actor's adapters (lora_flags.py checks the flags), None for full-parameter training; seeded
    by --seed."""
    c = cfg.lora
    if c.lora_rank == 0:
        return None
    return LoraConfig(rank=c.lora_rank, alpha=float(c.lora_alpha), dropout=c.lora_dropout,
                      target_modules=parse_target_modules(c.target_modules), seed=cfg.parallel.seed)


def critic_config(cfg: Config, total_steps: int | None = None) -> Critic.Config:
    """The critic's optimizer is the actor's (--optimizer, betas, weight decay, --clip-grad, decay
    style) with --critic-lr (default --lr) and --critic-lr-warmup-iters swapped in, as miles does
    (--lr-warmup-fraction is the actor's)."""
    a = cfg.algo
    optim = dataclasses.replace(cfg.optim, lr=cfg.optim.lr if a.critic_lr is None else a.critic_lr,
                                lr_warmup_iters=a.critic_lr_warmup_iters, lr_warmup_fraction=None)
    return Critic.Config(shard=shard_config(cfg), optim=optim, value_clip=a.value_clip,
                         total_steps=_run_steps(cfg, num_rollouts(cfg)) if total_steps is None else total_steps,
                         head_seed=cfg.parallel.seed)


def advantage_config(cfg: Config) -> AdvantageConfig:
    a = cfg.algo
    # miles requires whitening for the reinforce_plus_plus family (its returns are not centred);
    # furlong applies it for them whether or not --normalize-advantages is given
    whiten = a.normalize_advantages or a.advantage_estimator.startswith("reinforce_plus_plus")
    return AdvantageConfig(estimator=a.advantage_estimator, whiten=whiten, kl_type=a.kl_loss_type,
                           normalize_std=not a.disable_grpo_std_normalization,
                           # a reward post-process function replaces miles' group normalization (reward_post_process.py)
                           normalize_rewards=not a.disable_rewards_normalization
                           and cfg.custom.custom_reward_post_process_path is None, kl_coef=a.kl_coef,
                           gamma=a.gamma, lambd=a.lambd)


def shaping_config(cfg: Config) -> ShapingConfig:
    a = cfg.algo
    return ShapingConfig(overlong_buffer_len=a.overlong_buffer_len, overlong_penalty_factor=a.overlong_penalty_factor,
                         max_response_len=cfg.rollout.rollout_max_response_len)


def passes_config(cfg: Config) -> LogProbPasses:
    a = cfg.algo
    return log_prob_passes(a.use_rollout_logprobs, a.use_kl_loss, a.kl_coef, a.skip_actor_forward_only,
                           batching_config(cfg).num_optimizer_steps(_kept_samples(cfg)))


def rollout_config(cfg: Config) -> RolloutConfig:
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.rollout_temperature, top_p=r.rollout_top_p, top_k=r.rollout_top_k,
                              max_new_tokens=r.rollout_max_response_len, stop=list(r.rollout_stop),
                              stop_token_ids=list(r.rollout_stop_token_ids))
    over = r.rollout_batch_size if r.over_sampling_batch_size is None else r.over_sampling_batch_size
    return RolloutConfig(rollout_batch_size=r.rollout_batch_size, n_samples_per_prompt=r.n_samples_per_prompt,
                         over_sampling_batch_size=over, sampling=sampling, seed=rollout_seed(cfg),
                         max_context_len=r.rollout_max_context_len, partial_rollout=r.partial_rollout,
                         mask_offpolicy=r.mask_offpolicy_in_partial_rollout)


def generate_config(cfg: Config) -> GenerateConfig:
    return GenerateConfig(max_context_len=cfg.rollout.rollout_max_context_len,
                          chat_template_kwargs=chat_template_kwargs(cfg), flags=cfg)


def eval_max_response_len(cfg: Config) -> int:
    e, r = cfg.eval, cfg.rollout
    return r.rollout_max_response_len if e.eval_max_response_len is None else e.eval_max_response_len


def eval_config(cfg: Config) -> EvalConfig:
    """Each eval sampling setting falls back to the rollout's."""
    e, r = cfg.eval, cfg.rollout
    fallback = lambda value, rollout_value: rollout_value if value is None else value  # noqa: E731
    sampling = SamplingParams(temperature=fallback(e.eval_temperature, r.rollout_temperature),
                              top_p=fallback(e.eval_top_p, r.rollout_top_p), top_k=fallback(e.eval_top_k, r.rollout_top_k),
                              max_new_tokens=eval_max_response_len(cfg), stop=list(r.rollout_stop),
                              stop_token_ids=list(r.rollout_stop_token_ids), seed=rollout_seed(cfg))
    return EvalConfig(sampling=sampling, n_samples_per_prompt=e.n_samples_per_eval_prompt, interval=e.eval_interval,
                      before_train=not e.skip_eval_before_train)


def engine_config(cfg: Config, max_model_len: int) -> EngineConfig:
    """max_model_len: the longest prompt of the run's data sets plus the longest response (run set-up);
    raised to --rollout-max-context-len, the whole context a multi-turn sample may reach."""
    r = cfg.rollout
    max_model_len = max(max_model_len, r.rollout_max_context_len or 0)
    return EngineConfig(kv_fraction=r.rollout_kv_fraction, max_num_seqs=r.rollout_max_num_seqs,
                        decode_window=r.rollout_decode_window, max_model_len=max_model_len,
                        use_cuda_graphs=not r.rollout_enforce_eager, cascade=not r.rollout_no_cascade,
                        kv_dtype=r.rollout_kv_dtype, mix_prefill=not r.rollout_no_mix_prefill,
                        offload_weights="weight" in r.offload_rollout_level)


def checkpoint_config(cfg: Config) -> CheckpointConfig:
    """The actor's --save/--load and the critic's, by default beside them + "_critic" (miles' default;
    checkpoint/critic.py says why the critic's resume does not fall back to --load itself)."""
    c, a = cfg.ckpt, cfg.algo
    sibling = lambda path: None if path is None else path.rstrip("/") + "_critic"  # noqa: E731
    return CheckpointConfig(save=c.save, save_interval=c.save_interval, load=c.load,
                            critic_save=a.critic_save if a.critic_save is not None else sibling(c.save),
                            critic_load=a.critic_load if a.critic_load is not None else sibling(c.load),
                            source=cfg.data.hf_checkpoint)


def run_config(cfg: Config) -> RunConfig:
    a, lg, debug = cfg.algo, cfg.log, debug_config(cfg)
    checkpoint = checkpoint_config(cfg)
    if debug.rollout_only:   # nothing trains, so nothing is saved (miles)
        checkpoint = dataclasses.replace(checkpoint, save=None, critic_save=None)
    return RunConfig(
        num_rollout=num_rollouts(cfg), rollout=rollout_config(cfg), eval=eval_config(cfg),
        steps=batching_config(cfg), shaping=shaping_config(cfg), advantages=advantage_config(cfg),
        passes=passes_config(cfg), checkpoint=checkpoint, num_critic_only_steps=a.num_critic_only_steps,
        update_weight_buffer_size=cfg.batch.update_weight_buffer_size,
        save_debug_rollout_data=lg.save_debug_rollout_data == RUN_DIR_SAMPLES,
        ci_metric_key=lg.ci_metric_checker_key if lg.ci_test else None, ci_threshold=lg.ci_metric_checker_threshold,
        # with old log-probs from the engine the first step's ratio is not exactly 1
        ci_check_kl=lg.ci_test and not lg.ci_disable_kl_checker and not a.use_rollout_logprobs,
        max_nonfinite_skips=cfg.optim.max_nonfinite_skips, generate=generate_config(cfg), debug=debug,
        reward_logs=RewardLogConfig(cfg.metrics.log_passrate, cfg.metrics.log_reward_category),
        mismatch_metrics=cfg.metrics.get_mismatch_metrics, log_ois=cfg.metrics.get_mismatch_metrics or a.use_tis,
        ref_update_interval=cfg.ref.ref_update_interval, reset_optimizer_states=cfg.ref.reset_optimizer_states)


# miles' default --rollout-seed minus its default --seed: with neither flag given, runs draw as miles' do
ROLLOUT_SEED_OFFSET = 42 - 1234


def rollout_seed(cfg: Config) -> int:
    """--rollout-seed, else derived from --seed (so --seed alone decides every draw), offset so that
    miles' two defaults coincide (--seed 1234 gives --rollout-seed 42, miles' default)."""
    if cfg.data.rollout_seed is not None:
        return cfg.data.rollout_seed
    return (cfg.parallel.seed + ROLLOUT_SEED_OFFSET) % 2**63   # non-negative, as a flag value must be
