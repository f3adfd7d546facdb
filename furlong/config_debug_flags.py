"""miles' eval-set, reward-mode, metric, tracking and debugging flags (config.py's Config holds one
group of each; cli_flags.COMMAND_FLAGS says which command reads which).

Semantics follow miles' arguments.py; where furlong departs, the flag's help says so. `start_up_notes`
lists the flags given that have no effect in this run (said once at start-up, as the SGLang tuning
flags are): a field marked ignored="why" never has one, others only without the flag they need.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from furlong.config_field import RUN_DIR_SAMPLES, flag

if TYPE_CHECKING:
    from furlong.config import Config


@dataclass
class EvalSetFlags:
    eval_config: str | None = flag(None, "YAML/JSON file (or base64:<payload>) of eval sets, miles' format: "
                                   "eval: {defaults: {...}, datasets: [{name, path, ...}]}, with ${...} "
                                   "references between its keys; replaces --eval-prompt-data")
    eval_function_path: str | None = flag(None, "fn(args, rollout_id, data_source, evaluation=True) -> {name: "
                                          "samples} replacing the eval generation (module path); data_source "
                                          "is the run's eval sets")
    eval_max_prompt_len: int | None = flag(None, "drop eval prompts longer than this many tokens")
    eval_max_context_len: int | None = flag(None, "prompt + response tokens of an eval sample (default: "
                                            "--rollout-max-context-len)")
    eval_min_new_tokens: int | None = flag(None, "accepted, ignored: miles' built-in eval does not read it either",
                                           ignored="miles' own eval does not read it; the built-in engine has "
                                                   "no minimum response length")
    eval_reward_key: str | None = flag(None, "the reward function returns a dict: eval scores this key "
                                       "(default: --reward-key)")


@dataclass
class RewardModeFlags:
    group_rm: bool = flag(False, "call --custom-rm-path once per group: fn(samples) -> one reward per sample")


@dataclass
class MetricFlags:
    get_mismatch_metrics: bool = flag(False, "log engine-vs-trainer log-prob mismatch metrics (train/mis_*, "
                                      "train/train_rollout_*) and the new/old ratio train/ois; the loss is "
                                      "unchanged")
    log_passrate: bool = flag(False, "log pass@k (k = 1, 2, 4 .. n) of each rollout (passrate/) and eval set")
    log_reward_category: str | None = flag(None, "key of the reward dict (--reward-key) whose value is a "
                                           "category: log each category's share (rollout/error_cat/)")


@dataclass
class TrackingFlags:
    wandb_mode: str | None = flag(None, "online | offline | disabled (wandb.init's mode)")
    wandb_dir: str | None = flag(None, "directory for the wandb files (default: wandb's ./wandb)")
    wandb_run_id: str | None = flag(None, "wandb run id: resume that run (resume='allow')")
    wandb_team: str | None = flag(None, "wandb entity (team)")
    wandb_host: str | None = flag(None, "wandb server URL (login host)")
    tb_project_name: str | None = flag(None, "TensorBoard events in tensorboard_log/<name>/<run dir name> (miles' "
                                       "layout; $TENSORBOARD_DIR wins) instead of <output dir>/tensorboard")


@dataclass
class DebugFlags:
    debug_rollout_only: bool = flag(False, "rollouts only: no trainer is built (no trainer model, optimizer, "
                                    "reference or critic; nothing saved), the engine loads --hf-checkpoint, or "
                                    "--load's weights and prompt position; with --save-debug-rollout-data: "
                                    "record them")
    debug_train_only: bool = flag(False, "training only, on --load-debug-rollout-data: no generation, no eval")
    load_debug_rollout_data: str | None = flag(None, "replay saved rollouts into training instead of generating "
                                               "(implies --debug-train-only): a run directory saved with "
                                               "--save-debug-rollout-data or --dump-details, or a path "
                                               "template with {rollout_id} (--save-debug-rollout-data "
                                               "TEMPLATE's; furlong's JSONL, not miles' .pt)")
    save_debug_train_data: str | None = flag(None, "torch.save each rollout's train samples to this path "
                                             "template ({rollout_id}, {rank})")
    dump_details: str | None = flag(None, "debug dumps under this directory: rollout_data/{rollout_id}.jsonl "
                                    "and train_data/{rollout_id}_{rank}.pt")


def start_up_notes(cfg: Config) -> list[str]:
    """One note per given flag that has no effect in this run."""
    notes = [f"--eval-min-new-tokens {cfg.eval_set.eval_min_new_tokens}: accepted and ignored (miles' own eval "
             "does not read it; the built-in engine has no minimum response length)"] \
        if cfg.eval_set.eval_min_new_tokens is not None else []
    t = cfg.tracking
    given = [n for n in ("wandb_mode", "wandb_dir", "wandb_run_id", "wandb_team", "wandb_host")
             if getattr(t, n) is not None]
    if given and not cfg.log.use_wandb:
        notes.append(" ".join("--" + n.replace("_", "-") for n in given) + ": no effect without --use-wandb")
    if t.tb_project_name is not None and not cfg.log.use_tensorboard:
        notes.append("--tb-project-name: no effect without --use-tensorboard")
    if cfg.eval_set.eval_config is not None and cfg.eval.eval_prompt_data:
        notes.append("--eval-prompt-data: ignored, --eval-config gives the eval sets (as in miles)")
    if cfg.debug.dump_details is not None and cfg.log.save_debug_rollout_data is not None:
        notes.append("--save-debug-rollout-data: replaced by --dump-details' rollout_data/{rollout_id}.jsonl (as in "
                     "miles)")
    if cfg.debug.debug_rollout_only and cfg.ckpt.save is not None:
        notes.append("--save: nothing is saved under --debug-rollout-only (nothing trains)")
    if cfg.parallel.overlap_cpu_optimizer_d2h_h2d and not cfg.parallel.optimizer_cpu_offload:
        notes.append("--overlap-cpu-optimizer-d2h-h2d: no effect without --optimizer-cpu-offload")
    if cfg.reward_mode.group_rm and cfg.reward.custom_rm_path is None:
        notes.append("--group-rm: no effect without --custom-rm-path (built-in rewards score one sample at a time)")
    return notes


def check_debug_flags(cfg: Config) -> None:
    """This file's flags and their combinations; ValueError('--flag: why')."""
    def need(cond: bool, name: str, why: str) -> None:
        if not cond:
            raise ValueError(f"{name}: {why}")
    e, t, d = cfg.eval_set, cfg.tracking, cfg.debug
    need(t.wandb_mode in (None, "online", "offline", "disabled"), "--wandb-mode",
         f"expected online, offline or disabled, got {t.wandb_mode!r}")
    need(e.eval_max_prompt_len is None or e.eval_max_prompt_len >= 1, "--eval-max-prompt-len", "must be >= 1")
    need(e.eval_max_context_len is None or e.eval_max_context_len >= 2, "--eval-max-context-len",
         "must be >= 2 (a prompt token and a response token)")
    need(e.eval_min_new_tokens is None or e.eval_min_new_tokens >= 0, "--eval-min-new-tokens", "must be >= 0")
    need(e.eval_function_path is None or bool(e.eval_config or cfg.eval.eval_prompt_data), "--eval-function-path",
         "needs eval sets (--eval-prompt-data or --eval-config) to run on")
    need(cfg.metrics.log_reward_category is None or cfg.reward.reward_key is not None
         or e.eval_reward_key is not None, "--log-reward-category",
         "reads the reward function's dict: give --reward-key (or --eval-reward-key)")
    need(not (d.debug_rollout_only and (d.debug_train_only or d.load_debug_rollout_data is not None)),
         "--debug-rollout-only", "cannot be combined with --debug-train-only or --load-debug-rollout-data")
    need(not d.debug_train_only or d.load_debug_rollout_data is not None, "--debug-train-only",
         "needs --load-debug-rollout-data (the rollouts to train on; furlong has no rollout servers to leave out)")
    save = cfg.log.save_debug_rollout_data
    need(save is None or save == RUN_DIR_SAMPLES or "{rollout_id}" in save, "--save-debug-rollout-data",
         f"{save!r} has no {{rollout_id}}: every rollout would overwrite one file; give a path template with "
         "{rollout_id}, or the flag bare for the run directory's samples/")
    for name, template in (("--save-debug-train-data", d.save_debug_train_data),
                           ("--load-debug-rollout-data", d.load_debug_rollout_data),
                           ("--save-debug-rollout-data", save if save != RUN_DIR_SAMPLES else None)):
        try:
            if template is not None:
                template.format(rollout_id=0, rank=0)
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"{name}: {template!r} is not a path template ({{rollout_id}}, {{rank}}): "
                             f"{type(err).__name__} {err}") from None
