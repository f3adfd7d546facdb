"""Every flag of `furlong train/sft/eval`, defined once.

Each dataclass field is one flag: `hf_checkpoint` is `--hf-checkpoint`; miles' and SGLang's other
names for a flag are its `aliases` (this file is the one place they are declared). The CLI (cli.py)
is generated from these classes; config_checks.validate checks the values and raises ValueError
whose message starts with the offending flag, which the CLI prints as one line before exiting with
code 2. Names and meanings follow miles (docs/design.md §1), so the groups (`*Flags`) are miles'
grouping, not the components': config_map.py maps the flags onto each component's own config, with
every fallback (a flag defaulting to another's value) resolved there. `OptimConfig` is both: the
optimizer's config is exactly its flag group.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from furlong.config_field import RUN_DIR_SAMPLES, flag  # noqa: F401  (there so that config_debug_flags.py can use them too)


@dataclass
class DataFlags:
    hf_checkpoint: str | None = flag(None, "HF checkpoint directory (config.json, safetensors, tokenizer)")
    prompt_data: str | None = flag(None, "training prompts: .parquet or .jsonl, optional @[a:b] row slice")
    input_key: str = flag("input", "column holding the prompt (string or chat messages)")
    label_key: str | None = flag(None, "column holding the label")
    apply_chat_template: bool = flag(False, "format prompts with the tokenizer's chat template")
    rollout_shuffle: bool = flag(False, "shuffle prompts each epoch (seeded by --rollout-seed)")
    rollout_seed: int | None = flag(None, "seed for prompt shuffling and sampling (default: from --seed; "
                                                "42 with the default --seed, as in miles)")
    rollout_max_prompt_len: int | None = flag(None, "drop prompts longer than this many tokens")
    apply_chat_template_kwargs: str = flag("{}", "JSON object of extra chat-template arguments, e.g. "
                                           "'{\"enable_thinking\": false}' for Qwen3")
    tool_key: str = flag("tools", "column of tool specs given to the chat template (tools=...); rows without have none")
    metadata_key: str = flag("metadata", "column of a per-row metadata dict (Sample.metadata)")


@dataclass
class RewardFlags:
    rm_type: str | None = flag(None, "built-in reward: math | deepscaler | dapo")
    custom_rm_path: str | None = flag(None, "module.function computing a sample's reward (wins over --rm-type)")
    reward_timeout: float = flag(600.0, "seconds one reward call may take before the run stops")
    reward_key: str | None = flag(None, "the reward function returns a dict: train on this key's value")


@dataclass
class RolloutFlags:
    num_rollout: int | None = flag(None, "number of rollout/train steps (default: from --num-epoch, else 1)")
    rollout_batch_size: int = flag(8, "prompt groups kept per rollout")
    n_samples_per_prompt: int = flag(1, "responses generated per prompt")
    rollout_max_response_len: int = flag(1024, "max generated tokens per response")
    rollout_temperature: float = flag(1.0, "sampling temperature")
    rollout_top_p: float = flag(1.0, "nucleus sampling threshold")
    rollout_top_k: int = flag(-1, "top-k sampling (-1: off)")
    rollout_stop: list[str] = flag([], "stop strings", nargs="+")
    rollout_stop_token_ids: list[int] = flag([], "extra stop token ids", nargs="+")
    over_sampling_batch_size: int | None = flag(None, "groups submitted per generation round (default: rollout batch size)")
    dynamic_sampling_filter_path: str | None = flag(None, "group filter function (module path)")
    rollout_max_context_len: int | None = flag(None, "prompt + response tokens of a sample (multi-turn: all turns)")
    custom_generate_function_path: str | None = flag(
        None, "async fn(args, sample, sampling_params) -> Sample making each sample (module path; multi-turn, tools)")
    custom_generate_timeout: float = flag(600.0, "seconds one custom generate call may take")
    custom_generate_on_error: str = flag("stop", "a custom generate/rollout function fails on a sample: stop the run "
                                         "| drop the sample's group (counted)")
    rollout_function_path: str | None = flag(None, "fn(args, rollout_id, data_source, evaluation) -> sample groups: "
                                             "replaces the whole rollout step (module path)")
    partial_rollout: bool = flag(False, "once a rollout has its groups, pause the unfinished ones (tokens and "
                                 "log-probs kept) and continue them first in the next rollout, with the new weights")
    mask_offpolicy_in_partial_rollout: bool = flag(False, "--partial-rollout: the tokens a resumed sample made in "
                                                   "earlier rollouts do not train (loss mask 0)")
    rollout_num_gpus_per_engine: int = flag(1, "GPUs per rollout engine (built-in engine: one per rank)")
    rollout_num_gpus: int | None = flag(None, "GPUs for rollout (the built-in engine is colocated: the actor's)")
    rollout_kv_fraction: float = flag(0.8, "fraction of free GPU memory the engine's KV cache may take",
                                      aliases=["--sglang-mem-fraction-static"])
    rollout_max_num_seqs: int = flag(512, "engine: most sequences decoded together (largest CUDA-graph batch)")
    rollout_decode_window: int = flag(16, "engine: decode steps between host syncs (finished rows leave then)")
    rollout_enforce_eager: bool = flag(False, "engine: no CUDA graphs (debugging)")
    rollout_no_cascade: bool = flag(False, "engine: each sample reads its prompt's KV itself, not once per group")
    rollout_no_mix_prefill: bool = flag(False, "engine: work arriving while rows decode is prefilled in a step of "
                                        "its own, not behind their decode window")
    rollout_kv_dtype: str = flag("auto", "engine KV cache: auto (the model's dtype) | bf16 | fp8_e4m3 (half the bytes: "
                                 "~2x the tokens and faster long decodes; one scale per token and KV head)",
                                 aliases=["--sglang-kv-cache-dtype"])
    offload_rollout_level: list[str] = flag(
        ["kv_cache", "weight"], "what the engine gives back while the trainer runs: kv_cache (always) and weight "
        "(its weights too, written again by the weight update, which writes them all anyway; `kv_cache` alone "
        "keeps them resident)", nargs="+",
        miles="the KV cache is always released; the default is miles' with --colocate")
    sglang_decode_log_interval: int | None = flag(None, "SGLang only", sglang=True)
    sglang_enable_metrics: bool = flag(False, "SGLang only", sglang=True)


@dataclass
class EvalFlags:
    eval_interval: int | None = flag(None, "evaluate every K rollouts")
    eval_prompt_data: list[str] = flag([], "eval sets as name path [name path ...]", nargs="+")
    n_samples_per_eval_prompt: int = flag(1, "samples per eval prompt")
    eval_max_response_len: int | None = flag(None, "eval max response tokens (default: rollout's)")
    eval_temperature: float | None = flag(None, "eval temperature (default: rollout's)")
    eval_top_p: float | None = flag(None, "eval top-p (default: rollout's)")
    eval_top_k: int | None = flag(None, "eval top-k (default: rollout's)")
    eval_input_key: str | None = flag(None, "eval prompt column (default: --input-key)")
    eval_label_key: str | None = flag(None, "eval label column (default: --label-key)")
    skip_eval_before_train: bool = flag(False, "no eval before the first rollout")


@dataclass
class AlgoFlags:
    advantage_estimator: str = flag("grpo", "grpo | gspo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | "
                                   "ppo (GAE with a critic)")
    disable_grpo_std_normalization: bool = flag(False, "GRPO: only subtract the group mean")
    disable_rewards_normalization: bool = flag(False, "grpo/gspo/reinforce_plus_plus_baseline: raw rewards (no group mean or std)")
    normalize_advantages: bool = flag(False, "whiten advantages over the global batch (all ranks)")
    gamma: float = flag(1.0, "discount of the token-level returns (reinforce_plus_plus*, ppo)")
    lambd: float = flag(1.0, "GAE lambda (ppo)")
    loss_agg_mode: str = flag("seq-mean-token-mean", "seq-mean-token-mean (miles) | token-mean (DAPO; = "
                              "--calculate-per-token-loss) | seq-mean-token-sum-norm (Dr.GRPO: token sums over "
                              "--rollout-max-response-len)")
    overlong_buffer_len: int | None = flag(None, "DAPO overlong shaping: penalize the last N tokens before the max length")
    overlong_penalty_factor: float = flag(1.0, "DAPO overlong shaping: penalty at the max length")
    eps_clip: float = flag(0.2, "PPO clip range (low)")
    eps_clip_high: float | None = flag(None, "PPO clip range (high; default --eps-clip)")
    eps_clip_c: float | None = flag(None, "dual-clip constant c (> 1)")
    use_kl_loss: bool = flag(False, "add a KL loss against the reference (initial) model")
    kl_loss_coef: float = flag(0.0, "KL loss coefficient")
    kl_loss_type: str = flag("k1", "k1 | k2 | k3 | low_var_kl")
    kl_coef: float = flag(0.0, "KL penalty folded into the token rewards (reinforce_plus_plus*)")
    use_unbiased_kl: bool = flag(False, "KL loss times the importance ratio (unbiased off-policy estimate)")
    entropy_coef: float = flag(0.0, "entropy bonus coefficient")
    use_tis: bool = flag(False, "truncated importance sampling against the engine's log-probs")
    tis_clip: float = flag(2.0, "TIS weight cap")
    tis_clip_low: float = flag(0.0, "TIS weight floor")
    use_rollout_logprobs: bool = flag(False, "old log-probs from the engine (no trainer forward for them)")
    calculate_per_token_loss: bool = flag(False, "average the loss over all response tokens of the step")
    skip_actor_forward_only: bool | None = flag(None, "reuse training log-probs as old log-probs (default: when exact)")
    # the critic of --advantage-estimator ppo (miles' names; trainer/critic.py)
    value_clip: float = flag(0.2, "ppo: clip of the critic's values around their pre-update values")
    critic_hf_checkpoint: str | None = flag(None, "ppo: HF checkpoint the critic starts from (default: --hf-checkpoint)")
    critic_lr: float | None = flag(None, "ppo: critic learning rate (default: --lr)")
    critic_lr_warmup_iters: int = flag(0, "ppo: critic warm-up optimizer steps")
    num_critic_only_steps: int = flag(0, "ppo: first rollouts that train only the critic (the actor stays frozen)")
    critic_save: str | None = flag(None, "ppo: critic checkpoint directory (default: --save + '_critic')")
    critic_load: str | None = flag(None, "ppo: critic checkpoint to resume (default: --load + '_critic')")


@dataclass
class OptimConfig:
    optimizer: str = flag("adam", "adam (AdamW)")
    lr: float = flag(1e-6, "learning rate")
    min_lr: float = flag(0.0, "floor of the decayed learning rate")
    lr_decay_style: str = flag("constant", "constant | linear | cosine | inverse-square-root | WSD")
    lr_warmup_iters: int = flag(0, "warm-up optimizer steps")
    lr_warmup_fraction: float | None = flag(None, "warm-up as a fraction of --lr-decay-iters (wins over --lr-warmup-iters)")
    lr_warmup_init: float = flag(0.0, "learning rate at the start of the warm-up")
    lr_wsd_decay_style: str = flag("exponential", "--lr-decay-style WSD: the final decay's shape: exponential | "
                                   "linear | cosine | minus_sqrt", miles="default exponential, Megatron's")
    lr_wsd_decay_iters: int | None = flag(None, "--lr-decay-style WSD: optimizer steps of the final decay")
    lr_decay_iters: int | None = flag(None, "decay length in optimizer steps (default: whole run)")
    weight_decay: float = flag(0.0, "AdamW weight decay")
    adam_beta1: float = flag(0.9, "Adam beta1")
    adam_beta2: float = flag(0.95, "Adam beta2")
    adam_eps: float = flag(1e-8, "Adam epsilon")
    clip_grad: float = flag(1.0, "gradient norm clip (0: off)")
    max_nonfinite_skips: int = flag(5, "stop the run after this many optimizer steps in a row were skipped for a "
                                       "non-finite gradient norm (0: never; furlong only, miles has no such stop)")


@dataclass
class BatchFlags:
    global_batch_size: int | None = flag(None, "samples per optimizer step (default: all kept samples)")
    num_steps_per_rollout: int | None = flag(None, "optimizer steps per rollout (overrides the global batch size)")
    micro_batch_size: int = flag(1, "samples per micro-batch without dynamic batching")
    use_dynamic_batch_size: bool = flag(False, "pack micro-batches by token count")
    max_tokens_per_gpu: str | None = flag(None, "token budget per micro-batch, or 'auto'")
    gradient_checkpointing: bool = flag(False, "recompute decoder layers in backward")
    update_weight_buffer_size: int = flag(512 * 1024**2, "bytes per weight-sync bucket")


@dataclass
class ParallelFlags:
    actor_num_nodes: int = flag(1, "nodes (beyond 1: launch with torchrun)")
    actor_num_gpus_per_node: int = flag(1, "worker processes started on this node")
    colocate: bool = flag(False, "engine and trainer share the GPUs (the built-in engine always does)")
    train_backend: str = flag("fsdp", "fsdp")
    device: str = flag("auto", "auto | cpu | cuda")
    dtype: str = flag("auto", "compute dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32")
    torch_compile: str = flag("auto", "compile the trainer's decoder layers and log-prob kernels: auto (on CUDA) | on | off")
    fsdp_cpu_offload: bool = flag(False, "fp32 master weights, gradients and AdamW state in CPU memory (FSDP2 CPU "
                                  "offload): trains models whose optimizer state does not fit the GPU; the "
                                  "optimizer step runs on the CPU")
    optimizer_cpu_offload: bool = flag(False, "AdamW's two moments in pinned CPU memory, streamed to the GPU in "
                                       "buckets for each update; fp32 master weights and gradients stay on the GPU "
                                       "(8 bytes per parameter on each side instead of 16 on one)",
                                       miles="Megatron's flag; furlong's own placement: the update runs on the GPU "
                                             "(trainer/optimizer_offload.py)")
    overlap_cpu_optimizer_d2h_h2d: bool = flag(
        False, "accepted for miles/Megatron recipes: --optimizer-cpu-offload always overlaps its moment copies "
               "with the update (two side streams), so this changes nothing",
        miles="Megatron's flag; furlong's offloaded optimizer always overlaps (trainer/optimizer_offload.py)")
    fsdp_reshard_after_forward: bool = flag(
        False, "free each layer's gathered weights after its forward and re-gather them in backward and for "
               "every micro-batch (saves one compute-dtype copy of the model per rank; slower)")
    seed: int = flag(1234, "seeds every random draw: python, numpy and torch, and the rollout's sampling and "
                           "prompt order unless --rollout-seed is given")
    distributed_timeout_minutes: int = flag(10, "minutes any collective (and the rendezvous) may wait for a peer "
                                            "before the run stops with one line naming it")
    use_fault_tolerance: bool = flag(False, "resume by itself: --load defaults to --save, so workers that "
                                     "torchrun restarts (--max-restarts N) continue from the last checkpoint")


@dataclass
class CheckpointFlags:
    save: str | None = flag(None, "checkpoint directory")
    save_interval: int | None = flag(None, "save every K rollouts")
    load: str | None = flag(None, "resume from this checkpoint directory")
    ckpt_step: int | None = flag(None, "with --load: load iteration N (iter_N) instead of the latest",
                                 aliases=["--load-iteration"])


@dataclass
class LogFlags:
    output_dir: str | None = flag(None, "run directory (default runs/<date-time>)")
    overwrite: bool = flag(False, "reuse an --output-dir that already holds a run (its files are replaced)")
    use_tensorboard: bool = flag(False, "write TensorBoard events")
    use_wandb: bool = flag(False, "log to Weights & Biases")
    wandb_project: str | None = flag(None, "wandb project")
    wandb_group: str | None = flag(None, "wandb group")
    wandb_key: str | None = flag(None, "wandb API key")
    disable_wandb_random_suffix: bool = flag(False, "no random suffix on the wandb run name")
    save_debug_rollout_data: str | None = flag(
        None, "write each training rollout's samples to this path template ({rollout_id}; eval samples to "
              "rollout_id eval_<id>), miles' form; the content is furlong's JSONL rollout file (run/debug_data.py), "
              "not miles' .pt pickle, and --load-debug-rollout-data replays it. Bare: "
              "<output-dir>/samples/rollout_train_<k>.jsonl", const=RUN_DIR_SAMPLES)
    ci_test: bool = flag(False, "fail the run unless an eval metric reaches the threshold")
    ci_disable_kl_checker: bool = flag(False, "skip the step-0 ppo_kl ~ 0 check")
    ci_metric_checker_key: str | None = flag(None, "metric checked by --ci-test")
    ci_metric_checker_threshold: float | None = flag(None, "threshold for --ci-metric-checker-key")


@dataclass
class LoraFlags:
    """LoRA RL (miles' flags, peft's semantics; models/lora.py). Checked in lora_flags.py."""
    lora_rank: int = flag(0, "LoRA rank: train adapters of this rank on a frozen base (0: full-parameter training)")
    lora_alpha: float = flag(16.0, "LoRA alpha: the adapters' output is scaled by alpha / rank")
    lora_dropout: float = flag(0.0, "LoRA dropout on the adapters' input (training forwards only)")
    target_modules: str = flag("all-linear", "projections that get adapters: all-linear (every linear layer of "
                               "the decoder blocks, not the LM head) or names, e.g. q_proj,k_proj,v_proj,o_proj")


@dataclass
class SftFlags:
    sft_max_len: int = flag(2048, "SFT: truncate samples to this many tokens")


from furlong.config_debug_flags import DebugFlags, EvalSetFlags, MetricFlags, RewardModeFlags, TrackingFlags  # noqa: E402
from furlong.config_train_flags import CustomFunctionFlags, ReferenceFlags, RunLengthFlags  # noqa: E402


@dataclass
class Config:
    data: DataFlags = field(default_factory=DataFlags)
    reward: RewardFlags = field(default_factory=RewardFlags)
    rollout: RolloutFlags = field(default_factory=RolloutFlags)
    eval: EvalFlags = field(default_factory=EvalFlags)
    algo: AlgoFlags = field(default_factory=AlgoFlags)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch: BatchFlags = field(default_factory=BatchFlags)
    parallel: ParallelFlags = field(default_factory=ParallelFlags)
    ckpt: CheckpointFlags = field(default_factory=CheckpointFlags)
    log: LogFlags = field(default_factory=LogFlags)
    lora: LoraFlags = field(default_factory=LoraFlags)
    sft: SftFlags = field(default_factory=SftFlags)
    eval_set: EvalSetFlags = field(default_factory=EvalSetFlags)
    reward_mode: RewardModeFlags = field(default_factory=RewardModeFlags)
    metrics: MetricFlags = field(default_factory=MetricFlags)
    tracking: TrackingFlags = field(default_factory=TrackingFlags)
    debug: DebugFlags = field(default_factory=DebugFlags)
    ref: ReferenceFlags = field(default_factory=ReferenceFlags)
    length: RunLengthFlags = field(default_factory=RunLengthFlags)
    custom: CustomFunctionFlags = field(default_factory=CustomFunctionFlags)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def eval_sets(self) -> list[tuple[str, str]]:
        """--eval-prompt-data's (name, path) pairs."""
        items = self.eval.eval_prompt_data
        return [(items[i], items[i + 1]) for i in range(0, len(items), 2)]
