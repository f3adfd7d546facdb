"""The RL loop of docs/design.md §2, top to bottom.

Every rank runs this same loop. Rollout is data-parallel (each rank generates
its share of prompt groups, then all ranks exchange them), so every rank holds
the same kept groups; the actor then splits the samples token-balanced across
ranks for training. Only rank 0 writes files.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from furlong.config import Config
from furlong.run.metrics import Progress, progress_line, write_samples
from furlong.rollout.rollout import RolloutBatch, RolloutSpec
from furlong.run.rollout_step import eval_step, rollout_step
from furlong.run.user_functions import UserFunctions
from furlong.run.setup import RunParts, build_run
from furlong.launch.signals import StopRequest
from furlong.run.specs import checkpoint_paths, eval_spec, rollout_spec, sample_spec
from furlong.trainer.mfu import mfu
from furlong.checkpoint.run import save_run
from furlong.run.train_samples import build_train_samples
from furlong.trainer.weight_sync import sync_weights
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


def _rollout(parts: RunParts, spec: RolloutSpec, rollout_id: int) -> RolloutBatch:
    """One rollout (run/rollout_step.py picks which); the engine's KV cache is freed after it."""
    return rollout_step(parts, spec, rollout_id)


def _run_evals(parts: RunParts, rollout_id: int) -> dict[str, float]:
    spec, out = eval_spec(parts.cfg), {}
    for name, prompts in parts.eval_sets:
        t = time.perf_counter()
        n = spec.n_samples_per_prompt
        parts.logger.line(f"[eval {name}] generating {len(prompts)} prompts x {n} samples ...")
        res = eval_step(parts, name, prompts, spec)   # frees the KV cache, as after a rollout
        parts.logger.line(f"[eval {name}] {res.score:.3f} ({res.num_samples} samples, {time.perf_counter() - t:.1f}s)")
        out[f"eval/{name}"] = res.score
        if parts.ctx.rank == 0:
            write_samples(parts.output_dir, name, rollout_id, res.samples)
    return out


def _save(parts: RunParts, rollout_id: int) -> None:
    path = save_run(checkpoint_paths(parts.cfg), parts.actor, parts.critic, parts.dataset, rollout_id)
    parts.logger.line(f"saved checkpoint {path} (after rollout {rollout_id + 1})")


def run_rl(cfg: Config, ctx: DistContext, user: UserFunctions | None = None) -> int:
    """`furlong train`; `user`: the Python API's callables in place of module-path flags (api.py)."""
    parts = build_run(cfg, ctx, with_actor=True, user=user)   # validates every input before anything is written
    logger = parts.logger
    ci = CiChecker(cfg.log.ci_metric_checker_key if cfg.log.ci_test else None,
                   cfg.log.ci_metric_checker_threshold,
                   cfg.log.ci_test and not cfg.log.ci_disable_kl_checker and not cfg.algo.use_rollout_logprobs)
    num_rollout = cfg.rollout.num_rollout
    progress = Progress(num_rollout, start_step=parts.start_rollout)

    if parts.eval_sets and not cfg.eval.skip_eval_before_train and parts.start_rollout == 0:
        t = time.perf_counter()
        m = _run_evals(parts, -1)
        ci.observe(m)
        logger.log(0, {**m, "perf/eval_time": time.perf_counter() - t}, kind="eval")
        logger.line("[eval before training] " + " | ".join(f"{k} {v:.3f}" for k, v in m.items()))

    with StopRequest() as stop:
        code = _rollouts(parts, ci, progress, stop)
    if code:
        logger.close()
        return code
    if cfg.ckpt.save is not None and num_rollout > parts.start_rollout and not (
            cfg.ckpt.save_interval and num_rollout % cfg.ckpt.save_interval == 0):
        _save(parts, num_rollout - 1)   # always leave the final state on disk
    logger.close()
    ci.final()
    return 0


class PhaseClock:
    """Wall-clock seconds of named phases of one step (`with clock("perf/x_time"): ...`)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def _rollouts(parts: RunParts, ci: "CiChecker", progress: Progress, stop: StopRequest) -> int:
    """The RL steps; 0, or 128 + signal when a SIGINT/SIGTERM stopped the run after a whole step."""
    cfg, ctx, actor, critic, logger = parts.cfg, parts.ctx, parts.actor, parts.critic, parts.logger
    num_rollout, eval_every = cfg.rollout.num_rollout, cfg.eval.eval_interval
    spec, shaping = rollout_spec(cfg), sample_spec(cfg)
    for rollout_id in range(parts.start_rollout, num_rollout):
        clock = PhaseClock()
        batch = _rollout(parts, spec, rollout_id)
        with clock("perf/log_probs_time"):
            # advantages, old/ref log-probs; with a critic (ppo) its values and the returns
            samples = build_train_samples(batch.groups, shaping, actor, critic)
        metrics = batch.metrics.as_log()
        if critic is not None:   # miles' order: the critic trains first, on the values GAE used
            with clock("perf/critic_train_time"):
                metrics.update(critic.train_step(samples).to_log())
        # --num-critic-only-steps: the first rollouts warm the critic up while the actor stays frozen
        if rollout_id >= cfg.algo.num_critic_only_steps:
            with clock("perf/actor_train_time"):
                tm = actor.train_step(samples)
            if rollout_id == cfg.algo.num_critic_only_steps:
                ci.check_first_step_kl(tm.ppo_kl)
            with clock("perf/update_weights_time"):
                sync_weights(actor.model, parts.engine.model, cfg.batch.update_weight_buffer_size)
            metrics.update(tm.to_log())
        if cfg.log.save_debug_rollout_data and ctx.rank == 0:
            write_samples(parts.output_dir, "train", rollout_id, batch.samples, prefix="rollout")
        if eval_every is not None and parts.eval_sets and (rollout_id + 1) % eval_every == 0:
            with clock("perf/eval_time"):
                m = _run_evals(parts, rollout_id)
            ci.observe(m)
            metrics.update(m)
        # perf/rollout_time and perf/rollout_tok_per_s come from the rollout's own clock (as_log)
        metrics.update(clock.seconds)
        metrics["perf/step_time"] = clock.elapsed()
        if "perf/actor_train_time" in clock.seconds:
            t_train, num_train_tokens = clock.seconds["perf/actor_train_time"], sum(s.num_tokens for s in samples)
            metrics["perf/actor_train_tok_per_s"] = num_train_tokens / max(t_train, 1e-9)
            # 6*N FLOPs per token over the peak of the GPUs in use (train/mfu.py)
            metrics["perf/actor_train_mfu"] = mfu(parts.num_params, num_train_tokens, t_train, ctx.device,
                                                  ctx.world_size)
        if torch.cuda.is_available():
            metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        # The metrics line is on disk before the checkpoint's tracker moves past this rollout: a crash
        # between the two repeats the line on resume (cut back then), never loses it.
        logger.log(rollout_id, metrics)
        logger.line(progress_line(rollout_id, num_rollout, metrics, progress.eta(rollout_id + 1)))
        saved = cfg.ckpt.save is not None and cfg.ckpt.save_interval and (rollout_id + 1) % cfg.ckpt.save_interval == 0
        if saved:
            _save(parts, rollout_id)
        signum = stop.agreed(ctx.world_size, ctx.device)
        if signum:
            if cfg.ckpt.save is not None and not saved:
                _save(parts, rollout_id)
            logger.line(f"furlong: stopped by signal {signum} after rollout {rollout_id + 1}/{num_rollout}"
                        + (f"; resume with --load {cfg.ckpt.save}" if cfg.ckpt.save is not None else ""))
            return 128 + signum
    return 0


def run_eval_only(cfg: Config, ctx: DistContext) -> int:
    """`furlong eval`: the eval sets of --eval-prompt-data on --hf-checkpoint."""
    if not cfg.eval.eval_prompt_data:
        raise ValueError("--eval-prompt-data: required for furlong eval")
    parts = build_run(cfg, ctx, with_actor=False)
    m = _run_evals(parts, -1)
    parts.logger.log(0, m, kind="eval")
    if ctx.rank == 0:
        print(json.dumps(m))
    parts.logger.close()
    return 0
