"""Training-side miles flags (issue 23): the reference model, the run's length and start, user loss and
reward functions. Groups of config.Config like config.py's (`cfg.ref`, `cfg.length`, `cfg.custom`), with
their checks and the one resolution that needs the data (--num-epoch -> --num-rollout).

miles' semantics, and where furlong departs:
- --ref-load: miles' FSDP backend reads an HF folder (its Megatron backend a torch_dist checkpoint, which
  furlong cannot read: refused with one line); furlong also takes a furlong --save directory
  (--ref-ckpt-step picks its iteration). Without it the reference is --hf-checkpoint, as before.
- --ref-update-interval N: after rollout ids N-1, 2N-1, ... the reference becomes the actor's weights
  (miles). Deviation: on resume miles rebuilds the reference from --ref-load; furlong restores the one
  the uninterrupted run would hold (the actor of the last update's checkpoint), so a resumed run repeats it.
- --reset-optimizer-states: miles' Megatron backend zeroes Adam's moments and step counts at the start of
  every rollout's training (its FSDP backend ignores the flag); furlong does it for the actor and the critic.
- --num-epoch: num_rollout = num_epoch * prompts // --rollout-batch-size when --num-rollout is not given
  (prompts: after the --rollout-max-prompt-len filter, miles' dataset size); both given: --num-epoch is
  ignored with a note, as miles logs. Neither: 1 rollout (miles asserts; furlong keeps its default).
  `furlong sft` reads the same flag as its passes over the data (default 1).
- --start-rollout-id: the first rollout id; given with --load it wins over the checkpoint's (miles).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from furlong.config import flag

if TYPE_CHECKING:
    from furlong.config import Config


REF_PLACEMENTS = ("auto", "gpu", "cpu")


@dataclass
class ReferenceFlags:
    ref_load: str | None = flag(None, "reference model of --use-kl-loss / --kl-coef: an HF folder or a furlong --save "
                                      "directory (default: --hf-checkpoint)",
                                miles="an HF folder or a furlong --save directory; a Megatron torch_dist directory is "
                                      "refused with one line")
    ref_ckpt_step: int | None = flag(None, "with a furlong --ref-load directory: its iteration N (default: the latest)")
    ref_update_interval: int | None = flag(None, "every N rollouts the reference becomes the actor's current weights "
                                                 "(after rollouts N, 2N, ...)",
                                           miles="a resume restores the reference of the last update (miles: --ref-load "
                                                 "again)")
    ref_placement: str = flag("auto", "where the reference's weights live between its passes: gpu (a bf16 copy, "
                                      "sharded like the actor), cpu (pinned CPU memory, copied to the GPU once per "
                                      "log-prob pass), auto (cpu with --fsdp-cpu-offload or when the bf16 copy "
                                      "would take more than 1/20 of a GPU's memory, else gpu)",
                              miles="furlong's own (miles keeps its reference on the CPU between uses)")
    reset_optimizer_states: bool = flag(False, "zero the optimizer's moments and step counts before each rollout's "
                                               "training (actor and critic; the LR schedule goes on)",
                                        miles="as miles' Megatron backend (its FSDP backend ignores it)")


@dataclass
class RunLengthFlags:
    num_epoch: int | None = flag(None, "train: passes over the prompts when --num-rollout is not given (num_rollout = "
                                       "num_epoch * prompts // --rollout-batch-size); sft: passes over the data "
                                       "(default 1)",
                                miles="neither --num-epoch nor --num-rollout: 1 rollout (miles refuses)")
    start_rollout_id: int | None = flag(None, "first rollout id (default: 0, or the one after the --load checkpoint's, "
                                              "which this flag overrides)")


@dataclass
class CustomFunctionFlags:
    """User functions of the loss and the rewards (algorithms/custom_loss.py, run/reward_post_process.py
    give their signatures; docs/miles_flags.md repeats them)."""
    loss_type: str = flag("policy_loss", "policy_loss | custom_loss (--custom-loss-function-path)",
                          miles="policy_loss or custom_loss (sft_loss: furlong sft)")
    custom_loss_function_path: str | None = flag(
        None, "--loss-type custom_loss: fn(args, batch, log_probs, entropy, sum_of_sample_mean) -> (loss, metrics "
              "dict); per-sample lists of [R_i] tensors (module path; algorithms/custom_loss.py)",
        miles="fn(args, batch, log_probs, entropy, sum_of_sample_mean) -> (loss, metrics): per-sample log-probs "
              "[R_i] of the sampled tokens instead of logits; metrics named like train/* (algorithms/custom_loss.py)")
    custom_tis_function_path: str | None = flag(
        None, "--use-tis: fn(args, *, pg_loss [R], train_log_probs, rollout_log_probs, loss_masks (lists of [R_i]), "
              "**kw) -> (pg_loss [R], loss_masks, metrics dict) in place of the TIS weights (module path)",
        miles="fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, "
              "parallel_state=None, max_seq_lens=None) -> (pg_loss, loss_masks, metrics); needs --use-tis; metrics "
              "checked, not logged")
    custom_pg_loss_reducer_function_path: str | None = flag(
        None, "fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer(pg [R]) -> "
              "scalar: the policy term's aggregation (module path)",
        miles="fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer(pg [R]) -> "
              "scalar, per micro-batch; scaled by 1 / global batch (per-token: 1 / the step's loss tokens)")
    custom_reward_post_process_path: str | None = flag(
        None, "fn(args, samples: list[Sample]) -> (raw_rewards, rewards): the rewards the advantages use, in place "
              "of the group normalization (module path)",
        miles="fn(args, samples) -> (raw_rewards, rewards) with furlong's Sample objects; raw_rewards not logged")
    custom_config_path: str | None = flag(
        None, "YAML file (or base64:<payload>) of flag values keyed by flag name with underscores; flags given on "
              "the command line win",
        miles="the command line wins (miles: the file); every key must be a flag (miles: any key)")


def num_rollouts(cfg: Config) -> int:
    """--num-rollout, 1 when not given (run set-up resolves --num-epoch into it first: resolve_num_rollout)."""
    return 1 if cfg.rollout.num_rollout is None else cfg.rollout.num_rollout


def sft_epochs(cfg: Config) -> int:
    return 1 if cfg.length.num_epoch is None else cfg.length.num_epoch


def resolve_num_rollout(cfg: Config, num_prompts: int) -> int:
    """The run's rollout count, --num-epoch applied as miles does (module docstring)."""
    r, n = cfg.rollout, cfg.length.num_epoch
    if r.num_rollout is not None or n is None:
        return num_rollouts(cfg)
    out = n * num_prompts // r.rollout_batch_size
    if out < 1:
        raise ValueError(f"--num-epoch: {n} epoch(s) of {num_prompts} prompts make no rollout of "
                         f"--rollout-batch-size {r.rollout_batch_size}")
    return out


def start_notes(cfg: Config) -> list[str]:
    """What these flags leave unused in this run, said once at start-up (cli.py)."""
    a, ref, notes = cfg.algo, cfg.ref, []
    uses_ref = a.use_kl_loss or a.kl_coef > 0
    if not uses_ref and ref.ref_load is not None:
        notes.append("--ref-load is unused without --use-kl-loss or --kl-coef (the actor starts from --hf-checkpoint)")
    if not uses_ref and ref.ref_update_interval is not None:
        notes.append("--ref-update-interval is unused without --use-kl-loss or --kl-coef")
    if ref.ref_placement != "auto" and (not uses_ref or cfg.lora.lora_rank > 0):
        notes.append(f"--ref-placement {ref.ref_placement} is unused: "
                     + ("with --lora-rank the reference is the base model (adapters off), no copy"
                        if uses_ref else "no reference without --use-kl-loss or --kl-coef"))
    if cfg.rollout.num_rollout is not None and cfg.length.num_epoch is not None:
        notes.append("--num-epoch is ignored: --num-rollout is given (as miles)")
    return notes


def _need(cond: bool, flag_name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{flag_name}: {msg}")


def check_train_flags(cfg: Config) -> None:
    """ValueError('--flag: why') for a bad value of these flags (config_checks.validate calls it)."""
    ref, length, c = cfg.ref, cfg.length, cfg.custom
    _need(ref.ref_ckpt_step is None or ref.ref_load is not None, "--ref-ckpt-step", "needs --ref-load")
    _need(ref.ref_ckpt_step is None or ref.ref_ckpt_step >= 1, "--ref-ckpt-step", "must be >= 1")
    _need(ref.ref_update_interval is None or ref.ref_update_interval >= 1, "--ref-update-interval", "must be >= 1")
    _need(ref.ref_placement in REF_PLACEMENTS, "--ref-placement",
          f"unknown placement {ref.ref_placement!r} ({', '.join(REF_PLACEMENTS)})")
    if cfg.lora.lora_rank > 0:   # the LoRA reference is the base with the adapters off: no copy to load or move
        _need(ref.ref_load is None, "--ref-load", "with --lora-rank the reference is the base model (adapters off)")
        _need(ref.ref_update_interval is None, "--ref-update-interval",
              "with --lora-rank the reference is the base model (adapters off) and cannot follow the actor")
    _need(length.num_epoch is None or length.num_epoch >= 1, "--num-epoch", "must be >= 1")
    _need(length.start_rollout_id is None or length.start_rollout_id >= 0, "--start-rollout-id", "must be >= 0")
    _need(c.loss_type in ("policy_loss", "custom_loss"), "--loss-type",
          f"unknown type {c.loss_type!r} (policy_loss, custom_loss)")
    _need((c.loss_type == "custom_loss") == (c.custom_loss_function_path is not None), "--loss-type",
          "custom_loss and --custom-loss-function-path go together")
    _need(c.custom_tis_function_path is None or cfg.algo.use_tis, "--custom-tis-function-path", "needs --use-tis")
    for name in ("custom_loss_function_path", "custom_tis_function_path", "custom_pg_loss_reducer_function_path",
                 "custom_reward_post_process_path"):
        value = getattr(c, name)
        _need(value is None or value.strip() != "", "--" + name.replace("_", "-"),
              "is empty; give module.function or leave the flag out")
