"""The RL loop of docs/design.md §2: for each rollout id, the step's stages (run/step.py), then
eval, the metrics line and the checkpoint.

Every rank runs this same loop. Rollout is data-parallel (each rank generates
its share of prompt groups, then all ranks exchange them), so every rank holds
the same kept groups; the trainers then split the samples token-balanced across
ranks. Only rank 0 writes files.

Counting: a run's iterations are rollout ids 0 .. --num-rollout - 1. metrics.jsonl's "step" is the
rollout id (miles' name), and the checkpoint written after rollout id r is iter_{r + 1} (miles'
numbering: iterations done), which --ckpt-step and latest_checkpointed_iteration.txt count too.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from furlong.checkpoint.run import save_run
from furlong.config import Config
from furlong.launch.failure import Position
from furlong.launch.signals import StopRequest
from furlong.run.debug_data import save_rollout_rows
from furlong.run.evals import run_evals
from furlong.run.metrics import Progress, progress_line, write_samples
from furlong.run.setup import RunParts, build_run
from furlong.run.user_functions import UserFunctions
from furlong.trainer.memory_plan import TrainerOutOfMemory, out_of_memory_line
from furlong.trainer.memory_probe import unused_memory_flags
from furlong.run.step import StageClock, StepOutput, releases_engine_weights, rl_step
from furlong.trainer.mfu import mfu
from furlong.trainer.nonfinite import NonFiniteGuard
from furlong.types import DistContext


@dataclass
class CiChecker:
    """--ci-test: some eval must reach the threshold; step 0's ppo_kl must be ~0 unless disabled."""
    key: str | None
    threshold: float | None
    check_kl: bool
    best: float | None = None

    def observe(self, metrics: dict[str, float]) -> None:
        if self.key is not None and self.key in metrics:
            v = metrics[self.key]
            self.best = v if self.best is None else max(self.best, v)

    def check_first_step_kl(self, ppo_kl: float) -> None:
        # With old log-probs from the same weights the ratio is exactly 1 at the first micro-batch.
        if self.check_kl and abs(ppo_kl) > 1e-6:
            raise CiFailure(f"--ci-test: ppo_kl at step 0 is {ppo_kl:.3g}, expected 0 "
                            "(old and new log-probs disagree; --ci-disable-kl-checker skips this)")

    def final(self) -> None:
        if self.key is None:
            return
        if self.best is None:
            raise CiFailure(f"--ci-metric-checker-key: no eval produced {self.key!r}")
        if self.best < self.threshold:
            raise CiFailure(f"--ci-test: best {self.key} = {self.best:.4f} < threshold {self.threshold}")


class CiFailure(RuntimeError):
    pass


def _save(parts: RunParts, rollout_id: int) -> None:
    t = time.perf_counter()
    path = save_run(parts.config.checkpoint, parts.actor, parts.critic, parts.dataset, rollout_id, parts.paused)
    parts.logger.line(f"saved checkpoint {path} (after rollout {rollout_id + 1}, {time.perf_counter() - t:.1f}s)")


def run_rl(cfg: Config, ctx: DistContext, position: Position | None = None, user: UserFunctions | None = None) -> int:
    """`position`: where this rank is (launch/failure.py names it if the run fails); a fresh one if None.
    `user`: the Python API's callables in place of module-path flags (api.py)."""
    position = position or Position(rank=ctx.rank)
    parts = build_run(cfg, ctx, with_actor=True, user=user)   # validates every input before anything is written
    config, logger = parts.config, parts.logger
    ci = CiChecker(config.ci_metric_key, config.ci_threshold, config.ci_check_kl)
    progress = Progress(config.num_rollout, start_step=parts.start_rollout)

    if parts.eval_sets and config.eval.before_train and parts.start_rollout == 0:
        t = time.perf_counter()
        m = run_evals(parts, -1)
        ci.observe(m)
        logger.log(0, {**m, "perf/eval_time": time.perf_counter() - t}, kind="eval")
        logger.line("[eval before training] " + " | ".join(f"{k} {v:.3f}" for k, v in m.items()))

    with StopRequest() as stop:
        code = _rollouts(parts, ci, progress, stop, position)
    if code:
        logger.close()
        return code
    num_rollout, ckpt = config.num_rollout, config.checkpoint
    if ckpt.save is not None and num_rollout > parts.start_rollout and not (
            ckpt.save_interval and num_rollout % ckpt.save_interval == 0):
        with position.stage("save", num_rollout - 1):
            _save(parts, num_rollout - 1)   # always leave the final state on disk
    logger.close()
    ci.final()
    return 0


def _step_metrics(parts: RunParts, step: StepOutput, clock: StageClock) -> dict[str, float]:
    """The step's metrics line: the stages' own, their perf/<stage>_time, and the rates derived from them."""
    ctx, metrics = parts.ctx, {**step.metrics, **clock.seconds}
    # the name miles' dashboards read: both log-prob passes (0 when the training forward supplies them)
    metrics["perf/log_probs_time"] = (clock.seconds.get("perf/old_log_probs_time", 0.0)
                                      + clock.seconds.get("perf/ref_log_probs_time", 0.0))
    metrics["perf/step_time"] = clock.elapsed()
    if step.train is not None:
        t_train, num_train_tokens = clock.seconds["perf/actor_train_time"], sum(s.num_tokens for s in step.samples)
        metrics["perf/actor_train_tok_per_s"] = num_train_tokens / max(t_train, 1e-9)
        # 6*N FLOPs per token (about 4*N under LoRA) over the peak of the GPUs in use (trainer/mfu.py)
        metrics["perf/actor_train_mfu"] = mfu(parts.train_flops_per_token, num_train_tokens, t_train, ctx.device,
                                              ctx.world_size)
    if torch.cuda.is_available():
        metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    return metrics


def _out_of_memory_line(parts: RunParts, stage: str, rollout_id: int) -> str:
    """The one line a real out-of-memory ends the run with: the budget and mode in force, the flags to add."""
    actor, config = parts.actor, parts.config
    # the actor's training steps release the engine's weights (set-up's memory plan asks the same), or
    # there are none on the GPU to release
    weights_free = (releases_engine_weights(parts.engine.cfg.offload_weights, config, config.num_critic_only_steps)
                    or parts.engine.device.type != "cuda")
    flags_off = unused_memory_flags(actor, weights_free) if actor is not None else ()
    recompute = actor is not None and actor.model.gradient_checkpointing
    return out_of_memory_line(stage, rollout_id, config.steps.max_tokens_per_gpu, recompute, flags_off)


def _rollouts(parts: RunParts, ci: CiChecker, progress: Progress, stop: StopRequest, position: Position) -> int:
    """The RL steps; 0, or 128 + signal when a SIGINT/SIGTERM stopped the run after a whole step."""
    config, ctx, logger = parts.config, parts.ctx, parts.logger
    num_rollout, eval_every, ckpt = config.num_rollout, config.eval.interval, config.checkpoint
    skips = NonFiniteGuard(parts.config.max_nonfinite_skips)
    for rollout_id in range(parts.start_rollout, num_rollout):
        clock = StageClock(position, rollout_id)
        try:
            step = rl_step(parts, rollout_id, clock)                 # rollout ... weight sync (run/step.py)
        except torch.OutOfMemoryError as e:   # one line, not a traceback: the saved state is untouched
            raise TrainerOutOfMemory(_out_of_memory_line(parts, clock.current, rollout_id)) from e
        if step.train is not None and rollout_id == config.num_critic_only_steps:
            ci.check_first_step_kl(step.train.ppo_kl)
        if config.save_debug_rollout_data and ctx.rank == 0:
            write_samples(parts.output_dir, "train", rollout_id, step.batch.samples, prefix="rollout")
        if config.debug.save_rollout_data is not None and ctx.rank == 0:   # a template, or --dump-details
            save_rollout_rows(config.debug.save_rollout_data, rollout_id, step.batch.samples)
        if eval_every is not None and parts.eval_sets and (rollout_id + 1) % eval_every == 0:
            m = clock.run("eval", run_evals, parts, rollout_id)
            ci.observe(m)
            step.metrics.update(m)
        metrics = _step_metrics(parts, step, clock)
        # The metrics line is on disk before the checkpoint's tracker moves past this rollout: a crash
        # between the two repeats the line on resume (cut back then), never loses it.
        logger.log(rollout_id, metrics)
        logger.line(progress_line(rollout_id, num_rollout, metrics, progress.eta(rollout_id + 1)))
        if "train/num_steps" in metrics:   # --max-nonfinite-skips, once the step's line is on disk
            skips.observe(int(metrics["train/num_steps"]), int(metrics["train/num_skipped_steps"]),
                          f"rollout {rollout_id + 1}")
        saved = ckpt.save is not None and ckpt.save_interval and (rollout_id + 1) % ckpt.save_interval == 0
        if saved:
            with position.stage("save", rollout_id):
                _save(parts, rollout_id)
        signum = stop.agreed(ctx.world_size, ctx.device)
        if signum:
            if ckpt.save is not None and not saved:
                with position.stage("save", rollout_id):
                    _save(parts, rollout_id)
            logger.line(f"furlong: stopped by signal {signum} after rollout {rollout_id + 1}/{num_rollout}"
                        + (f"; resume with --load {ckpt.save}" if ckpt.save is not None else ""))
            return 128 + signum
    return 0


def run_eval_only(cfg: Config, ctx: DistContext) -> int:
    """`furlong eval`: the eval sets of --eval-prompt-data on --hf-checkpoint."""
    if not cfg.eval.eval_prompt_data and cfg.eval_set.eval_config is None:
        raise ValueError("--eval-prompt-data: required for furlong eval (or --eval-config)")
    parts = build_run(cfg, ctx, with_actor=False)
    m = run_evals(parts, -1)
    parts.logger.log(0, m, kind="eval")
    if ctx.rank == 0:
        print(json.dumps(m))
    parts.logger.close()
    return 0
