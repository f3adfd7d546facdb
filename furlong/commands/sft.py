"""`furlong sft`: supervised fine-tuning with the RL trainer and a cross-entropy loss.

Each row's input is a chat (`--input-key`, default messages) whose last turn is
the assistant's. The prompt is the chat template of the earlier turns with the
generation prompt; the loss covers the assistant turn's tokens (content and the
end-of-turn token), aggregated per sample as the RL loss is (each sample's token
mean, averaged over the batch). `--save DIR` receives an HF checkpoint.

Outputs follow train's rules: a run directory holding metrics.jsonl is refused unless --overwrite
(which starts it over), and --save must be new or empty unless --overwrite (safe_paths.py), both
checked before the model loads. SIGINT/SIGTERM stop after the current step; the weights so far
are then saved to --save as at the end, and the exit code is 128 + signal.
"""
from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from furlong.config import Config
from furlong.config_train_flags import sft_epochs
from furlong.run.metrics import MetricsLogger, Progress, format_duration
from furlong.launch.signals import StopRequest
from furlong.seeding import seed_everything
from furlong.trainer.nonfinite import NonFiniteGuard
from furlong.types import DistContext, TrainSample

if TYPE_CHECKING:
    from furlong.trainer.actor import Actor
    from furlong.trainer.trainer_config import BatchingConfig


def sft_samples(path_spec: str, tokenizer, input_key: str, max_len: int) -> list[TrainSample]:
    """Chat rows -> TrainSamples with the loss on the final assistant turn."""
    from furlong.data import DataError, load_rows
    rows = load_rows(path_spec, input_key, None)
    out = []
    for r in rows:
        msgs = r.raw
        if not isinstance(msgs, list) or not msgs or not isinstance(msgs[-1], dict) \
                or msgs[-1].get("role") != "assistant":
            raise DataError(f"{path_spec}: row {r.row + 1}: {input_key!r} must be chat messages ending "
                            "with an assistant turn")
        prompt = tokenizer.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(msgs, tokenize=False)
        if not full.startswith(prompt):
            raise DataError(f"{path_spec}: row {r.row + 1}: the chat template does not extend the prompt")
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(full[len(prompt):].rstrip("\n"), add_special_tokens=False)["input_ids"]
        ids = (p_ids + r_ids)[:max_len]
        num_r = len(ids) - len(p_ids)
        if num_r <= 0:
            raise DataError(f"{path_spec}: row {r.row + 1}: prompt fills --sft-max-len {max_len}")
        zeros = torch.zeros(num_r)   # the cross-entropy reads neither advantages nor log-probs
        out.append(TrainSample(token_ids=torch.tensor(ids, dtype=torch.long), num_prompt_tokens=len(p_ids),
                               advantages=zeros, rollout_log_probs=zeros))
    return out


def save_hf_checkpoint(model: torch.nn.Module, src_ckpt: Path, out_dir: str, rank: int) -> None:
    """Gather the sharded weights (every rank takes part) and write an HF checkpoint on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from furlong.models.hf_config import ModelArgs
    from furlong.models.hf_io import save_hf
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        try:
            save_hf(sd, ModelArgs.from_dir(src_ckpt), out_dir, tokenizer_src=src_ckpt)
        except OSError as e:   # disk full, read-only: one line; the target holds what it held before
            from furlong.checkpoint.store import SaveError
            raise SaveError(f"--save: writing {out_dir} failed ({e.strerror or e})") from e


def check_sft_outputs(cfg: Config, hf_checkpoint: Path) -> Path:
    """The run directory, after train's rules (a directory holding a run's metrics.jsonl is refused
    unless --overwrite), and --save checked as an output target (safe_paths); nothing is written."""
    from furlong.data import parse_path_spec
    from furlong.run.preflight import check_writable
    from furlong.safe_paths import check_dir_target
    out = Path(cfg.log.output_dir or f"runs/sft-{time.strftime('%Y%m%d-%H%M%S')}")
    check_writable(out, "--output-dir")
    if (out / "metrics.jsonl").exists() and not cfg.log.overwrite:
        raise ValueError(f"--output-dir: {out} already holds a run (metrics.jsonl); pass --overwrite to replace it "
                         "or choose another directory")
    if cfg.ckpt.save is not None:
        check_dir_target(cfg.ckpt.save, "--save", {"--hf-checkpoint": hf_checkpoint,
                                                   "--prompt-data": parse_path_spec(cfg.data.prompt_data)[0]},
                         cfg.log.overwrite)
    return out


def run_sft(cfg: Config, ctx: DistContext) -> int:
    from furlong.models.hf_io import load_pretrained
    from furlong.run.preflight import check_hf_checkpoint
    from furlong.config_map import actor_config, batching_config
    from furlong.trainer.actor import Actor

    ckpt, _, tokenizer = check_hf_checkpoint(cfg.data.hf_checkpoint)
    key = cfg.data.input_key if cfg.data.input_key != "input" else "messages"
    samples = sft_samples(cfg.data.prompt_data, tokenizer, key, cfg.sft.sft_max_len)
    out = check_sft_outputs(cfg, ckpt)   # before training: a bad target must not cost the run
    gbs = min(cfg.batch.global_batch_size or len(samples), len(samples))
    # the actor splits each step by the batch it is handed: give it the clamped size, not the flag's
    cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, global_batch_size=gbs))
    steps_per_epoch = len(samples) // gbs
    total = steps_per_epoch * sft_epochs(cfg)
    seed_everything(cfg.parallel.seed)
    actor = Actor(load_pretrained(ckpt, dtype=torch.float32, device=ctx.device),
                  actor_config(cfg, total_steps=total), ctx, loss="sft")
    steps = batching_config(cfg)
    from furlong.launch.distributed import barrier
    barrier()   # every rank has checked the run directory before rank 0 writes into it
    if ctx.rank == 0 and cfg.log.overwrite and (out / "metrics.jsonl").exists():
        (out / "metrics.jsonl").unlink()   # --overwrite starts the metrics over (train's rule)
    logger = MetricsLogger(out, enabled=ctx.rank == 0)
    if ctx.rank == 0:
        from furlong.run.identity import new_run_id, run_record
        (out / "config.json").write_text(json.dumps(run_record(cfg, new_run_id()), indent=1, default=str))
    with StopRequest() as stop:
        done, signum = _steps(cfg, ctx, actor, steps, samples, gbs, steps_per_epoch, logger, stop)
    if cfg.ckpt.save is not None:   # also after a signal, as train's final save: the weights so far
        save_hf_checkpoint(actor.model, ckpt, cfg.ckpt.save, ctx.rank)
        if ctx.rank == 0:
            print(f"sft: wrote HF checkpoint {cfg.ckpt.save}", flush=True)
    logger.close()
    if signum:
        if ctx.rank == 0:
            print(f"furlong: sft stopped by signal {signum} after step {done}/{steps_per_epoch * sft_epochs(cfg)}"
                  + (f"; its weights are in {cfg.ckpt.save}" if cfg.ckpt.save else ""), file=sys.stderr, flush=True)
        return 128 + signum
    return 0


def _steps(cfg: Config, ctx: DistContext, actor: Actor, steps: BatchingConfig, samples: list[TrainSample], gbs: int,
           steps_per_epoch: int,
           logger: MetricsLogger, stop: StopRequest) -> tuple[int, int | None]:
    """The SFT steps: (steps done, None or the signal that stopped them after a whole step)."""
    total = steps_per_epoch * sft_epochs(cfg)
    progress = Progress(total)
    skips = NonFiniteGuard(cfg.optim.max_nonfinite_skips)
    step = 0
    for epoch in range(sft_epochs(cfg)):
        order = list(range(len(samples)))
        random.Random(cfg.parallel.seed + epoch).shuffle(order)   # same order on every rank
        for b in range(steps_per_epoch):
            batch = [samples[i] for i in order[b * gbs:(b + 1) * gbs]]
            m = actor.train_step(batch, steps)
            step += 1
            logger.log(step, {"sft/loss": m.loss, "train/grad_norm": m.grad_norm, "train/lr": m.lr,
                              "train/num_micro_batches": m.num_micro_batches,
                              "perf/actor_train_tok_per_s": m.num_tokens / max(m.seconds, 1e-9)}, kind="sft")
            skips.observe(m.num_steps, m.num_skipped_steps, f"sft step {step}")   # after its line is logged
            if ctx.rank == 0 and (step % 10 == 0 or step == total):
                print(f"[sft {step}/{total} epoch {epoch + 1}] loss {m.loss:.4f} | lr {m.lr:.2e} | "
                      f"{m.num_tokens / max(m.seconds, 1e-9):.0f} tok/s | ETA {format_duration(progress.eta(step))}",
                      flush=True)
            signum = stop.agreed(ctx.world_size, ctx.device)
            if signum:
                return step, signum
    return step, None
