"""Builds the parts of a run from a Config: inputs first, then models, then outputs.

Order matters for the "nothing written half-way" rule: step 1 (preflight.check_inputs) checks
every input before the output directory is created; step 2 loads the models, step 3 opens the
outputs and, on --load, restores the checkpoint. The result, `RunParts`, is plain data the loop
reads; what the loop does with it (rollout, train, sync, save) is spelled out in loop.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from furlong.config import Config
from furlong.run.metrics import MetricsLogger
from furlong.run.tracking import tensorboard_dir, wandb_settings
from furlong.run.identity import prepare_run_dirs, run_record
from furlong.run.preflight import check_inputs
from furlong.seeding import seed_everything
from furlong.launch.distributed import barrier
from furlong.trainer.fsdp import compute_dtype
from furlong.types import DistContext, Sample

if TYPE_CHECKING:   # the engine and trainer modules are imported when a run builds them, not at import
    from transformers import PreTrainedTokenizerBase

    from furlong.config_map import RunConfig
    from furlong.data import PromptDataset
    from furlong.engine import Engine
    from furlong.rollout.eval import EvalSet
    from furlong.rollout.filters import GroupFilter
    from furlong.rollout.partial import PausedGroups
    from furlong.run.user_functions import RolloutFunctions, UserFunctions
    from furlong.trainer.actor import Actor
    from furlong.trainer.critic import Critic


def eos_token_ids(path: Path, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids: the tokenizer's eos plus generation_config.json's (Qwen lists several)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen = path / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        for x in (e if isinstance(e, list) else [e]):
            if x is not None and int(x) not in ids:
                ids.append(int(x))
    return ids



@dataclass
class RunParts:
    """Everything one rank's run reads; built once by build_run, no behaviour of its own."""
    config: RunConfig                          # what the loop and its stages read (config_map.run_config)
    ctx: DistContext
    output_dir: Path
    logger: MetricsLogger
    dataset: PromptDataset | None              # training prompts (None for `furlong eval`)
    eval_sets: list[EvalSet]                   # the eval sets with their settings and rewards (rollout/eval.py)
    engine: Engine                             # the rollout engine, with its own model copy
    reward_fn: Callable[[Sample], float]
    filter_fn: GroupFilter | None              # --dynamic-sampling-filter-path
    actor: Actor | None                        # None for `furlong eval`
    start_rollout: int                         # first rollout id to run (after a resume: the next one)
    train_flops_per_token: int                 # the actor's training FLOPs per token (MFU; trainer/mfu.py)
    critic: Critic | None = None               # ppo only
    functions: RolloutFunctions | None = None  # custom generate / rollout functions (run/rollout_step.py)
    paused: PausedGroups | None = None         # --partial-rollout: groups paused by one rollout for the next


def build_run(cfg: Config, ctx: DistContext, with_actor: bool, user: UserFunctions | None = None) -> RunParts:
    from furlong.config_map import actor_config, critic_config, engine_config, max_tokens_is_auto, run_config
    from furlong.engine import Engine
    from furlong.models.hf_io import load_pretrained

    # 1. inputs (nothing written yet)
    seed_everything(cfg.parallel.seed)   # also LoRA's dropout draws (models/lora.py); a resume restores the saved state
    inputs = check_inputs(cfg, with_actor, user)
    cfg = inputs.config   # --num-epoch resolved into --num-rollout (the data size decides)
    ckpt, tokenizer, max_resp, resume, out = (inputs.hf_checkpoint, inputs.tokenizer, inputs.max_response_len,
                                              inputs.resume, inputs.output_dir)
    dataset, critic_ckpt = inputs.dataset, inputs.critic_checkpoint

    # 2. models; --debug-rollout-only builds no trainer (no model copy, optimizer, reference or critic), so a
    # model too big to train can still be rolled out: the engine's weights come from the checkpoint itself
    trains = with_actor and not cfg.debug.debug_rollout_only
    device = ctx.device
    dtype = compute_dtype(device, cfg.parallel.dtype)
    # past the host's memory the OOM killer ends the run silently
    if trains and (cfg.parallel.fsdp_cpu_offload or cfg.parallel.optimizer_cpu_offload):
        from furlong.run.host_memory import check_offload_host_memory
        check_offload_host_memory(cfg, inputs.model_args, ctx.world_size, inputs.reference is not None,
                                  dtype.itemsize, inputs.critic_model_args)
    engine_model = load_pretrained(ckpt, dtype=dtype, device=device)
    if resume is not None and not trains:   # furlong eval --load, or rollouts of the trained weights
        from furlong.checkpoint.store import load_model_weights
        load_model_weights(cfg.ckpt.load, engine_model, resume.iteration)
    num_params = sum(p.numel() for p in engine_model.parameters())
    max_prompt_len = max(len(p.token_ids) for p in inputs.prompts())
    engine = Engine(engine_model, tokenizer, eos_token_ids(ckpt, tokenizer),
                    engine_config(cfg, max_model_len=max_prompt_len + max_resp))
    config = run_config(cfg)
    actor = critic = None
    if trains:
        from furlong.trainer.actor import Actor
        # full-parameter: fp32 masters; LoRA: the frozen base in the compute dtype (fsdp.py), adapters fp32
        base_dtype = torch.float32 if cfg.lora.lora_rank == 0 else dtype
        from furlong.run.reference import load_reference, ref_on_cpu
        loss = "custom" if cfg.custom.loss_type == "custom_loss" else "rl"
        actor_cfg = dataclasses.replace(actor_config(cfg), ref_on_cpu=ref_on_cpu(
            cfg.ref.ref_placement, num_params, ctx.world_size, device, cfg.parallel.fsdp_cpu_offload))
        actor = Actor(load_pretrained(ckpt, dtype=base_dtype, device=device), actor_cfg, ctx, loss=loss,
                      ref_model=load_reference(inputs.reference, ckpt, base_dtype, device))
        if critic_ckpt is not None:   # before the probe, which then measures with the critic (and its AdamW state)
            from furlong.trainer.critic import build_critic
            critic = build_critic(critic_config(cfg), ctx, critic_ckpt)
        if config.steps.use_dynamic_batch_size:
            # the memory plan, measured with the engine's weights placed as in every later step (resident, or
            # released by --offload-rollout-level weight): a budget that would not fit turns recompute on or is
            # lowered, with one line, instead of an OOM in step 1
            from furlong.run.step import releases_engine_weights, update_engine_weights
            from furlong.trainer.memory_plan import engine_reserved_bytes
            from furlong.trainer.memory_probe import plan_trainer_memory
            # as in the actor's training steps (a critic-only warm-up step does not train the actor)
            released = releases_engine_weights(engine.cfg.offload_weights, config, config.num_critic_only_steps)
            if released:
                engine.release_weights()
            reserved = engine_reserved_bytes(engine_model, released)
            requested = None if max_tokens_is_auto(cfg) else config.steps.max_tokens_per_gpu
            plan = plan_trainer_memory(actor, requested, cfg.batch.gradient_checkpointing,
                                       min_tokens=max_prompt_len + max_resp, reserved_bytes=reserved)
            if released and resume is not None:   # the resume below writes the checkpoint's weights: one sync
                engine.restore_weights()
            elif released:   # the probes took no optimizer step: the trainer still holds the loaded weights
                update_engine_weights(actor.model, engine, cfg.batch.update_weight_buffer_size)
            # one budget and recompute mode for both trainers: the critic's activations per token are the
            # actor's minus the log-prob chunks
            config = config.with_max_tokens(plan.max_tokens_per_gpu)
            for trainer in (actor, critic):
                if trainer is not None:
                    trainer.model.gradient_checkpointing = plan.gradient_checkpointing
                    if plan.reshard_after_forward:
                        trainer.enable_reshard_after_forward()
            if plan.note and ctx.rank == 0:
                print(plan.note, flush=True)

    # 3. outputs (rank 0 writes), once every rank has passed step 1: a slow rank's check of --output-dir
    # must not find the metrics.jsonl that rank 0's logger has just opened
    barrier()
    logger_enabled = ctx.rank == 0
    if logger_enabled:
        prepare_run_dirs(inputs.run_dirs)   # --overwrite's clearing, and the run id in each directory
        # a fresh start under --load (nothing saved yet: preflight.nothing_saved_yet) drops the lines of the
        # attempt that died before its first save, so each rollout is logged once
        fresh_restart = cfg.ckpt.load is not None and resume is None and trains
        if fresh_restart and (out / "metrics.jsonl").exists():
            (out / "metrics.jsonl").unlink()
        (out / "config.json").write_text(json.dumps(run_record(cfg, inputs.run_dirs.run_id), indent=1, default=str))
    wandb = login = None
    if cfg.log.use_wandb and logger_enabled:
        if cfg.log.wandb_key:
            os.environ["WANDB_API_KEY"] = cfg.log.wandb_key
        wandb, login = wandb_settings(cfg, out)   # run/tracking.py
    logger = MetricsLogger(out, enabled=logger_enabled, use_tensorboard=cfg.log.use_tensorboard,
                           wandb_settings=wandb, wandb_login=login, tensorboard_dir=tensorboard_dir(cfg, out))
    logger.line(f"run directory: {out}")
    if inputs.filter_fn is not None and dataset is not None:   # the bound of rollout.py, said up front
        from furlong.rollout.rollout import give_up_rule
        logger.line(give_up_rule(config.rollout, len(dataset), inputs.filter_fn.name))
    if resume is not None and not with_actor:
        logger.line(f"evaluating iteration {resume.iteration} of {cfg.ckpt.load} ({resume.path})")
    if actor is not None and actor.ref_model is not None:
        where = "in CPU memory between passes" if actor.cfg.ref_on_cpu else f"resident on the {device.type}"
        logger.line(f"reference model: {inputs.reference.what if inputs.reference else 'the initial weights'}, "
                    f"{where} (--ref-placement {cfg.ref.ref_placement})")

    start_rollout = cfg.length.start_rollout_id or 0   # --start-rollout-id wins over the checkpoint's (miles)
    paused = None
    if config.rollout.partial_rollout and with_actor:
        from furlong.rollout.partial import PausedGroups
        paused = PausedGroups()
    from furlong.checkpoint.run import load_run, resume_rollouts
    if resume is not None and actor is not None:
        from furlong.trainer.weight_sync import sync_weights
        state = load_run(config.checkpoint, actor, critic, dataset, resume.iteration, paused)
        if cfg.length.start_rollout_id is None:
            start_rollout = state.next_rollout_id
        sync_weights(actor.model, engine.model, cfg.batch.update_weight_buffer_size)
        dropped = logger.cut_back(start_rollout - 1)
        logger.line(f"resumed from iteration {resume.iteration} ({state.path}; rollout {state.rollout_id + 1} "
                    f"done); {dropped} metrics line(s) after it dropped from {out / 'metrics.jsonl'}")
    elif resume is not None and with_actor:   # --debug-rollout-only: the saved prompt order, without a trainer
        start_rollout = resume_rollouts(resume.trainer_state, dataset, paused, cfg.length.start_rollout_id)
    if with_actor and not trains:
        logger.line("--debug-rollout-only: no trainer; the engine holds " + (
            f"iteration {resume.iteration} of {cfg.ckpt.load} (prompts from rollout {start_rollout + 1} on)"
            if resume is not None else str(ckpt)))
    from furlong.trainer.mfu import model_flops_per_token
    eval_sets = [] if config.debug.train_only else inputs.eval_sets   # replayed rollouts: no eval (miles)
    return RunParts(config=config, ctx=ctx, output_dir=out, logger=logger, dataset=dataset, eval_sets=eval_sets,
                    engine=engine, reward_fn=inputs.reward_fn, filter_fn=inputs.filter_fn, actor=actor,
                    start_rollout=start_rollout, critic=critic, functions=inputs.functions, paused=paused,
                    train_flops_per_token=0 if actor is None else model_flops_per_token(actor.model))
