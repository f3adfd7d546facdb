"""Flag checks of `furlong train/sft/eval`: values and combinations, before any input is read.

The one place flags are validated: the components (engine, rollout, trainers) trust their configs.

`validate` raises ValueError('--flag: why'), which the CLI prints as one line and exits 2 (the flags
themselves are config.py's dataclasses; inputs such as files are checked later by preflight.py).
`sglang_flags_set` lists the SGLang-only flags given, which are accepted and reported as not applying.
"""
from __future__ import annotations

import dataclasses
import math

from furlong.config import Config, RolloutFlags
from furlong.config_debug_flags import check_debug_flags
from furlong.config_train_flags import check_train_flags
from furlong.lora_flags import check_lora_flags


def sglang_flags_set(cfg: Config) -> list[str]:
    """Flags given that only tune SGLang (reported once as not applying)."""
    out = []
    for f in dataclasses.fields(RolloutFlags):
        if f.metadata.get("sglang") and getattr(cfg.rollout, f.name) not in (None, False):
            out.append("--" + f.name.replace("_", "-"))
    return out


def chat_template_kwargs(cfg: Config) -> dict:
    """--apply-chat-template-kwargs parsed: a JSON object (ValueError naming the flag otherwise)."""
    import json
    try:
        value = json.loads(cfg.data.apply_chat_template_kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"--apply-chat-template-kwargs: not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--apply-chat-template-kwargs: expected a JSON object, got {type(value).__name__}")
    return value


def _need(cond: bool, flag_name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{flag_name}: {msg}")


def validate(cfg: Config, command: str = "train", reward_given: bool = False) -> None:
    """Check flag values and combinations; raise ValueError('--flag: why'). `reward_given`: the Python
    API hands in a reward callable (api.py), which stands for --custom-rm-path."""
    d, r, a, o, b, p, e = cfg.data, cfg.rollout, cfg.algo, cfg.optim, cfg.batch, cfg.parallel, cfg.eval
    if command in ("train", "sft") or (command == "eval" and cfg.ckpt.load is None):
        _need(d.hf_checkpoint is not None, "--hf-checkpoint", "required" + (" (or --load, whose checkpoint records "
                                                                             "it)" if command == "eval" else ""))
    if command in ("train", "sft"):
        _need(d.prompt_data is not None, "--prompt-data", "required")
    if command == "train":
        _need(reward_given or cfg.reward.rm_type is not None or cfg.reward.custom_rm_path is not None,
              "--rm-type", "give --rm-type or --custom-rm-path")
    _need(cfg.reward.reward_timeout > 0, "--reward-timeout", "must be > 0 seconds")
    chat_template_kwargs(cfg)
    _need(r.rollout_max_context_len is None or r.rollout_max_context_len >= 2, "--rollout-max-context-len",
          "must be >= 2 (a prompt token and a response token)")
    _need(r.custom_generate_timeout > 0, "--custom-generate-timeout", "must be > 0 seconds")
    _need(set(r.offload_rollout_level) <= {"kv_cache", "weight"}, "--offload-rollout-level",
          f"values are kv_cache and weight, got {' '.join(r.offload_rollout_level)}")
    _need(r.custom_generate_on_error in ("stop", "drop"), "--custom-generate-on-error",
          f"expected stop or drop, got {r.custom_generate_on_error!r}")
    _need(r.partial_rollout or not r.mask_offpolicy_in_partial_rollout, "--mask-offpolicy-in-partial-rollout",
          "needs --partial-rollout")
    _need(not (r.partial_rollout and (r.custom_generate_function_path or r.rollout_function_path)), "--partial-rollout",
          "not supported with --custom-generate-function-path or --rollout-function-path (a custom generate "
          "function has no resume contract; miles refuses it there too)")
    _need(r.num_rollout is None or r.num_rollout >= 0, "--num-rollout", "must be >= 0")
    _need(r.rollout_batch_size >= 1, "--rollout-batch-size", "must be >= 1")
    _need(r.n_samples_per_prompt >= 1, "--n-samples-per-prompt", "must be >= 1")
    _need(r.rollout_max_response_len >= 1, "--rollout-max-response-len", "must be >= 1")
    _need(r.rollout_temperature > 0 if command == "train" else r.rollout_temperature >= 0, "--rollout-temperature",
          "must be > 0 to train (log-probs divide by it)" if command == "train" else "must be >= 0")
    _need(0 < r.rollout_top_p <= 1, "--rollout-top-p", "must be in (0, 1]")
    _need(r.rollout_top_k == -1 or r.rollout_top_k >= 1, "--rollout-top-k", "must be -1 (off) or >= 1")
    _need(all(r.rollout_stop), "--rollout-stop", "stop strings must be non-empty")
    _need(r.over_sampling_batch_size is None or r.over_sampling_batch_size >= 1, "--over-sampling-batch-size",
          "must be >= 1")
    num_gpus = p.actor_num_nodes * p.actor_num_gpus_per_node
    _need(r.rollout_num_gpus is None or r.rollout_num_gpus == num_gpus, "--rollout-num-gpus",
          f"the built-in engine is colocated: it runs on the actor's {num_gpus} GPU(s)")
    _need(0 < r.rollout_kv_fraction < 1, "--rollout-kv-fraction", "must be in (0, 1)")
    _need(r.rollout_kv_dtype in ("auto", "bf16", "fp8_e4m3"), "--rollout-kv-dtype",
          f"unknown KV cache dtype {r.rollout_kv_dtype!r} (auto, bf16, fp8_e4m3)")
    _need(r.rollout_max_num_seqs >= 1, "--rollout-max-num-seqs", "must be >= 1")
    _need(1 <= r.rollout_decode_window <= 64, "--rollout-decode-window", "must be in [1, 64]")
    _need(len(e.eval_prompt_data) % 2 == 0, "--eval-prompt-data", "expects pairs: name path [name path ...]")
    _need(e.eval_interval is None or e.eval_interval >= 1, "--eval-interval", "must be >= 1")
    _need(e.n_samples_per_eval_prompt >= 1, "--n-samples-per-eval-prompt", "must be >= 1")
    has_evals = bool(e.eval_prompt_data) or cfg.eval_set.eval_config is not None
    _need(e.eval_interval is None or has_evals, "--eval-interval", "needs --eval-prompt-data (or --eval-config)")
    # an unset eval flag takes the rollout's value (config_map.eval_config), checked above
    _need(e.eval_temperature is None or e.eval_temperature >= 0, "--eval-temperature", "must be >= 0")
    _need(e.eval_top_p is None or 0 < e.eval_top_p <= 1, "--eval-top-p", "must be in (0, 1]")
    _need(e.eval_top_k is None or e.eval_top_k == -1 or e.eval_top_k >= 1, "--eval-top-k", "must be -1 (off) or >= 1")
    _need(e.eval_max_response_len is None or e.eval_max_response_len >= 1, "--eval-max-response-len", "must be >= 1")
    estimators = ("grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
    _need(a.advantage_estimator in estimators, "--advantage-estimator",
          f"unknown estimator {a.advantage_estimator!r} ({', '.join(estimators)})")
    _need(a.loss_agg_mode in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"), "--loss-agg-mode",
          f"unknown mode {a.loss_agg_mode!r} (seq-mean-token-mean, token-mean, seq-mean-token-sum-norm)")
    _need(not (a.calculate_per_token_loss and a.loss_agg_mode not in ("seq-mean-token-mean", "token-mean")),
          "--calculate-per-token-loss", f"means --loss-agg-mode token-mean, not {a.loss_agg_mode}")
    _need(a.overlong_buffer_len is None or 1 <= a.overlong_buffer_len < r.rollout_max_response_len,
          "--overlong-buffer-len", f"must be in [1, --rollout-max-response-len={r.rollout_max_response_len})")
    _need(a.overlong_penalty_factor >= 0, "--overlong-penalty-factor", "must be >= 0")
    _need(0 <= a.gamma <= 1, "--gamma", "must be in [0, 1]")
    _need(0 <= a.lambd <= 1, "--lambd", "must be in [0, 1]")
    _need(a.kl_coef >= 0, "--kl-coef", "must be >= 0")
    _need(a.kl_coef == 0 or a.advantage_estimator.startswith("reinforce_plus_plus"), "--kl-coef",
          f"the reward KL penalty applies to reinforce_plus_plus*, not {a.advantage_estimator} "
          "(use --use-kl-loss --kl-loss-coef)")
    _need(0 <= a.tis_clip_low <= a.tis_clip, "--tis-clip-low", "must be in [0, --tis-clip]")
    # TIS weighs by exp(old - rollout); old IS the rollout's log-probs under --use-rollout-logprobs,
    # so every weight would be exactly 1 and the flag would do nothing (miles refuses the pair too).
    _need(not (a.use_tis and a.use_rollout_logprobs), "--use-tis",
          "has no effect with --use-rollout-logprobs (old log-probs are the rollout's, so every weight is 1)")
    _need(a.value_clip > 0, "--value-clip", "must be > 0")
    _need(a.critic_lr is None or a.critic_lr >= 0, "--critic-lr", "must be >= 0")
    _need(a.critic_lr_warmup_iters >= 0, "--critic-lr-warmup-iters", "must be >= 0")
    _need(a.num_critic_only_steps >= 0, "--num-critic-only-steps", "must be >= 0")
    _need(a.advantage_estimator == "ppo" or a.num_critic_only_steps == 0, "--num-critic-only-steps",
          "needs --advantage-estimator ppo (no critic otherwise)")
    _need(a.critic_load is None or cfg.ckpt.load is not None, "--critic-load", "needs --load (the critic resumes with the actor)")
    _need(a.kl_loss_type in ("k1", "k2", "k3", "low_var_kl"), "--kl-loss-type",
          f"unknown type {a.kl_loss_type!r} (k1, k2, k3, low_var_kl)")
    _need(not (a.kl_coef != 0 and a.kl_loss_coef != 0), "--kl-coef",
          "cannot be combined with a non-zero --kl-loss-coef (reward penalty and KL loss both on)")
    _need(a.eps_clip > 0, "--eps-clip", "must be > 0")
    _need(a.eps_clip_c is None or a.eps_clip_c > 1, "--eps-clip-c", "must be > 1")
    _need(a.tis_clip > 0, "--tis-clip", "must be > 0")
    _need(o.optimizer == "adam", "--optimizer", f"unknown optimizer {o.optimizer!r} (adam)")
    styles = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
    _need(o.lr_decay_style in styles, "--lr-decay-style", f"unknown style {o.lr_decay_style!r} ({', '.join(styles)})")
    _check_optim(cfg)
    _need(b.micro_batch_size >= 1, "--micro-batch-size", "must be >= 1")
    _need(b.global_batch_size is None or b.global_batch_size >= 1, "--global-batch-size", "must be >= 1")
    _need(b.num_steps_per_rollout is None or b.num_steps_per_rollout >= 1, "--num-steps-per-rollout", "must be >= 1")
    if b.max_tokens_per_gpu is not None and b.max_tokens_per_gpu != "auto":
        try:
            ok = int(b.max_tokens_per_gpu) >= 1
        except ValueError:
            ok = False
        _need(ok, "--max-tokens-per-gpu", f"expected a positive integer or 'auto', got {b.max_tokens_per_gpu!r}")
    _need(not b.use_dynamic_batch_size or b.max_tokens_per_gpu is not None, "--use-dynamic-batch-size",
          "needs --max-tokens-per-gpu")
    _need(b.update_weight_buffer_size >= 1024, "--update-weight-buffer-size", "must be >= 1024 bytes")
    _need(p.train_backend == "fsdp", "--train-backend", f"unknown backend {p.train_backend!r} (fsdp)")
    _need(p.actor_num_gpus_per_node >= 1, "--actor-num-gpus-per-node", "must be >= 1")
    _need(p.actor_num_nodes >= 1, "--actor-num-nodes", "must be >= 1")
    _need(p.device in ("auto", "cpu", "cuda"), "--device", f"unknown device {p.device!r}")
    # one placement of the trainer's state or the other; LoRA may offload its adapters' moments (little to gain)
    _need(not (p.optimizer_cpu_offload and p.fsdp_cpu_offload), "--optimizer-cpu-offload",
          "cannot be combined with --fsdp-cpu-offload (which already keeps AdamW's moments, with the master "
          "weights and gradients, in CPU memory): give one of them")
    _need(p.distributed_timeout_minutes >= 1, "--distributed-timeout-minutes", "must be >= 1")
    _need(not p.use_fault_tolerance or cfg.ckpt.save is not None, "--use-fault-tolerance",
          "needs --save (a restarted worker resumes from the run's last checkpoint there)")
    _need(not p.use_fault_tolerance or cfg.ckpt.load in (None, cfg.ckpt.save) and cfg.ckpt.ckpt_step is None,
          "--use-fault-tolerance", "resumes from --save's latest checkpoint: leave --load unset (or equal to "
          "--save) and --ckpt-step unset")
    _need(p.dtype in ("auto", "bf16", "fp32"), "--dtype", f"unknown dtype {p.dtype!r}")
    _need(p.torch_compile in ("auto", "on", "off"), "--torch-compile", f"expected auto, on or off, got {p.torch_compile!r}")
    _need(cfg.ckpt.save_interval is None or cfg.ckpt.save is not None, "--save-interval", "needs --save")
    _need(cfg.ckpt.ckpt_step is None or cfg.ckpt.load is not None, "--ckpt-step", "needs --load")
    _need(cfg.ckpt.ckpt_step is None or cfg.ckpt.ckpt_step >= 1, "--ckpt-step", "must be >= 1")
    if command == "train":
        _need(r.num_rollout != 0 or has_evals, "--num-rollout",
              "0 trains nothing (give --eval-prompt-data for an eval-only run)")
        kept = r.rollout_batch_size * r.n_samples_per_prompt   # the rollout keeps exactly this many samples
        _need(b.num_steps_per_rollout is not None or b.global_batch_size is None or kept % b.global_batch_size == 0,
              "--global-batch-size", f"{b.global_batch_size} does not divide the {kept} samples of a rollout "
              "(--rollout-batch-size x --n-samples-per-prompt)")
        _need(b.num_steps_per_rollout is None or kept % b.num_steps_per_rollout == 0, "--num-steps-per-rollout",
              f"{b.num_steps_per_rollout} does not divide the {kept} samples of a rollout")
        num_steps = b.num_steps_per_rollout or (max(kept // b.global_batch_size, 1) if b.global_batch_size else 1)
        _need(not a.skip_actor_forward_only or num_steps == 1, "--skip-actor-forward-only",
              f"only exact with one optimizer step per rollout (this run takes {num_steps})")
    if cfg.log.use_tensorboard:
        import importlib.util
        _need(importlib.util.find_spec("tensorboard") is not None, "--use-tensorboard",
              "the tensorboard package is not installed")
    if cfg.log.use_wandb:
        import importlib.util
        _need(importlib.util.find_spec("wandb") is not None, "--use-wandb", "the wandb package is not installed")
    if cfg.log.ci_test:
        _need(cfg.log.ci_metric_checker_key is not None, "--ci-metric-checker-key", "required with --ci-test")
        _need(cfg.log.ci_metric_checker_threshold is not None, "--ci-metric-checker-threshold", "required with --ci-test")
    check_lora_flags(cfg)
    check_debug_flags(cfg)
    check_train_flags(cfg)
    _check_seeds_and_names(cfg)


def _check_optim(cfg: Config) -> None:
    """Optimizer values that would otherwise surface after the model loads, or never (a NaN loss)."""
    o = cfg.optim
    _need(math.isfinite(o.lr) and o.lr >= 0, "--lr", f"must be a finite number >= 0, got {o.lr}")
    _need(math.isfinite(o.min_lr) and o.min_lr >= 0, "--min-lr", f"must be a finite number >= 0, got {o.min_lr}")
    _need(o.min_lr <= o.lr, "--min-lr",
          f"{o.min_lr} is above --lr {o.lr}: the decay would raise the learning rate")
    _need(0 <= o.adam_beta1 < 1, "--adam-beta1", f"must be in [0, 1), got {o.adam_beta1}")
    _need(0 <= o.adam_beta2 < 1, "--adam-beta2", f"must be in [0, 1), got {o.adam_beta2}")
    _need(math.isfinite(o.adam_eps) and o.adam_eps > 0, "--adam-eps", f"must be a finite number > 0, got {o.adam_eps}")
    _need(math.isfinite(o.weight_decay) and o.weight_decay >= 0, "--weight-decay",
          f"must be a finite number >= 0, got {o.weight_decay}")
    _need(o.lr_warmup_iters >= 0, "--lr-warmup-iters", f"must be >= 0, got {o.lr_warmup_iters}")
    _need(o.lr_warmup_fraction is None or 0 <= o.lr_warmup_fraction < 1, "--lr-warmup-fraction",
          f"must be in [0, 1), got {o.lr_warmup_fraction}")
    _need(0 <= o.lr_warmup_init <= o.lr, "--lr-warmup-init", f"must be in [0, --lr {o.lr}], got {o.lr_warmup_init}")
    _need(o.lr_decay_style != "WSD" or (o.lr_wsd_decay_iters or 0) >= 1, "--lr-wsd-decay-iters",
          "--lr-decay-style WSD needs it (>= 1: the optimizer steps of the final decay)")
    wsd = ("exponential", "linear", "cosine", "minus_sqrt")
    _need(o.lr_wsd_decay_style in wsd, "--lr-wsd-decay-style", f"unknown style {o.lr_wsd_decay_style!r} ({', '.join(wsd)})")
    _need(o.lr_decay_iters is None or o.lr_decay_iters >= 1, "--lr-decay-iters",
          f"must be >= 1, got {o.lr_decay_iters}")
    _need(math.isfinite(o.clip_grad) and o.clip_grad >= 0, "--clip-grad", f"must be a finite number >= 0 (0: off)")
    _need(o.max_nonfinite_skips >= 0, "--max-nonfinite-skips", "must be >= 0 (0: never stop)")
    a = cfg.algo
    _need(a.critic_lr is None or math.isfinite(a.critic_lr), "--critic-lr", "must be finite")


def _check_seeds_and_names(cfg: Config) -> None:
    from furlong.seeding import MAX_SEED
    _need(0 <= cfg.parallel.seed <= MAX_SEED, "--seed", f"must be in [0, 2**63 - 1], got {cfg.parallel.seed}")
    rs = cfg.data.rollout_seed
    _need(rs is None or 0 <= rs <= MAX_SEED, "--rollout-seed", f"must be in [0, 2**63 - 1], got {rs}")
    _need(cfg.reward.custom_rm_path is None or cfg.reward.custom_rm_path.strip() != "", "--custom-rm-path",
          "is empty; give module.function or leave the flag out")
    names = [name for name, _ in cfg.eval_sets()]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    _need(dup is None, "--eval-prompt-data", f"two eval sets are named {dup!r}; their results and files would "
          "overwrite each other")
