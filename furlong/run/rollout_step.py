"""Which rollout a run's step takes, picked once here from its functions (run/user_functions.py):

  --rollout-function-path          the user's function makes the whole batch (rollout/custom_rollout.py)
  --custom-generate-function-path  the streaming rollout with a coroutine per sample (rollout/async_rollout.py)
  neither                          the streaming rollout over engine requests (rollout/rollout.py)
  --load-debug-rollout-data        none of them: the saved rollout is read back (run/debug_data.py)

Eval takes the custom generate function too when there is one (miles does), so a tool-using policy is
scored with its tools. Every path frees the engine's KV cache afterwards (colocated: the trainer needs it).
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING

from furlong.engine.async_front import AsyncEngine
from furlong.rollout.async_rollout import generate_eval_custom, generate_rollout_custom
from furlong.rollout.custom_generate import GenerateArgs
from furlong.rollout.custom_rollout import run_custom_rollout
from furlong.rollout.eval import EvalResult, EvalSet, run_eval
from furlong.rollout.rollout import RolloutBatch, RolloutConfig, generate_rollout
from furlong.run.debug_data import replay_batch

if TYPE_CHECKING:
    from furlong.run.setup import RunParts


def _front(parts: RunParts, evaluation: bool) -> tuple[AsyncEngine, GenerateArgs]:
    gen = parts.config.generate
    front = AsyncEngine(parts.engine, gen.max_context_len)
    args = GenerateArgs(engine=front, tokenizer=parts.engine.tokenizer, max_context_len=front.max_context_len,
                        chat_template_kwargs=dict(gen.chat_template_kwargs), evaluation=evaluation, config=gen.flags)
    return front, args


def rollout_step(parts: RunParts, cfg: RolloutConfig, rollout_id: int) -> RolloutBatch:
    if parts.config.debug.load_rollout_data is not None:   # --load-debug-rollout-data: no generation
        return replay_batch(parts.config.debug.load_rollout_data, rollout_id)
    fns = parts.functions
    try:
        if fns is not None and fns.rollout is not None:
            front, args = _front(parts, evaluation=False)
            num = cfg.rollout_batch_size * cfg.n_samples_per_prompt
            return run_custom_rollout(fns.rollout, fns.rollout_name, parts.dataset, front, args, parts.reward_fn,
                                      num, parts.ctx, rollout_id)
        if fns is not None and fns.generate is not None:
            front, args = _front(parts, evaluation=False)
            return generate_rollout_custom(parts.dataset, front, args, fns.generate, parts.reward_fn,
                                           parts.filter_fn, cfg, parts.ctx, rollout_id)
        return generate_rollout(parts.dataset, parts.engine, parts.reward_fn, parts.filter_fn, cfg, parts.ctx,
                                rollout_id, paused=parts.paused)
    finally:
        parts.engine.release()


def eval_step(parts: RunParts, es: EvalSet) -> EvalResult:
    fns, c = parts.functions, es.config
    n = c.n_samples_per_prompt
    try:
        if fns is None or fns.generate is None:
            return run_eval(es.name, es.prompts, parts.engine, es.reward_fn, c.sampling, n, parts.ctx,
                            c.max_context_len)
        if not es.prompts:
            raise ValueError(f"--eval-prompt-data: eval set {es.name!r} has no prompts")
        front, args = _front(parts, evaluation=True)
        seed = c.sampling.seed if c.sampling.seed is not None else random.getrandbits(63)
        groups = generate_eval_custom(es.prompts, front, args, fns.generate, es.reward_fn, c.sampling, n, seed,
                                      parts.ctx)
        samples = [s for g in groups for s in g.samples]
        score = sum(s.reward for s in samples) / max(len(samples), 1)
        return EvalResult(name=es.name, score=score, num_samples=len(samples), samples=samples)
    finally:
        parts.engine.release()
