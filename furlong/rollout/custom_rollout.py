"""--rollout-function-path: a user's function replaces the whole rollout step (miles' flag and call).

    def generate_rollout(args: GenerateArgs, rollout_id: int, data_source: PromptDataset,
                         evaluation: bool = False) -> list[list[Sample]] | RolloutOutput

(or `async def`: it is awaited while the engine serves its `args.engine` calls). It returns the
rollout's groups (lists of samples of one prompt, GRPO normalizes within each), or an object with
`samples` (the groups) and `metrics` (a dict of numbers, logged under rollout/custom/<key>), as
miles' RolloutFnTrainOutput. Its samples follow custom_generate.py's field rules (response_ids,
rollout_log_probs, loss_mask, status, reward); samples left with reward None are scored by the
run's reward function. It may take prompts from `data_source.next_batch(k)` (their order is saved
in checkpoints), or its data may come from anywhere: `furlong.rollout.async_rollout.new_sample`
makes a sample of any Prompt.

Data-parallel: every rank calls it; the step's batch is all ranks' groups in rank order, and it
must hold --rollout-batch-size x --n-samples-per-prompt samples (what the train step's batch sizes
were checked against). Deviation from miles: evaluation uses the run's eval path, not this function.
"""
from __future__ import annotations

import inspect
import math
import time
from typing import Any, Callable

from furlong.engine.async_front import AsyncEngine
from furlong.rollout.async_rollout import run_coroutine
from furlong.rollout.custom_generate import GenerateArgs, GenerateError, check_sample
from furlong.rollout.rollout import RolloutBatch, gather_lists, reward_groups
from furlong.rollout.rollout_metrics import summarize
from furlong.types import DistContext, Group, Sample

FLAG = "--rollout-function-path"


def _groups(name: str, out: Any) -> tuple[list[list[Any]], dict[str, float]]:
    metrics = getattr(out, "metrics", None) or {}
    groups = getattr(out, "samples", out)
    if not isinstance(groups, list) or not all(isinstance(g, list) and g for g in groups):
        raise GenerateError(f"{FLAG}: {name} returned {type(groups).__name__}, not a list of sample groups "
                            "(non-empty lists of Sample)")
    if not isinstance(metrics, dict) or not all(isinstance(v, (int, float)) and math.isfinite(v)
                                                for v in metrics.values()):
        raise GenerateError(f"{FLAG}: {name}: metrics must be a dict of finite numbers")
    return groups, metrics


def _checked(name: str, s: Any, group: int, index: int, max_context_len: int) -> Sample:
    if not isinstance(s, Sample):
        raise GenerateError(f"{FLAG}: {name} returned {type(s).__name__} as sample {index} of group {group}, "
                            "not a furlong Sample")
    return check_sample(name, s, s, max_context_len)


def run_custom_rollout(fn: Callable[..., Any], name: str, dataset: Any, front: AsyncEngine, args: GenerateArgs,
                       reward_fn: Callable[[Sample], Any], num_samples: int, ranks: DistContext | None,
                       rollout_id: int) -> RolloutBatch:
    started = time.perf_counter()
    front.engine.reset_stats()
    try:
        out = fn(args, rollout_id, dataset, evaluation=False)
        if inspect.isawaitable(out):
            out = run_coroutine(front.serve(out))
    except GenerateError:
        raise
    except Exception as e:   # the user's code: one line naming it
        raise GenerateError(f"{FLAG}: {name} raised on rollout {rollout_id}: {type(e).__name__}: {e}"
                            .splitlines()[0]) from e
    raw, extra = _groups(name, out)
    groups = [Group(group_id=i, samples=[_checked(name, s, i, j, args.max_context_len) for j, s in enumerate(g)])
              for i, g in enumerate(raw)]
    t0 = time.perf_counter()
    reward_groups(groups, reward_fn)
    reward_seconds = time.perf_counter() - t0
    groups = gather_lists(groups, ranks)
    got = sum(len(g.samples) for g in groups)
    if got != num_samples:
        raise GenerateError(f"{FLAG}: {name} returned {got} samples; the train step expects {num_samples} "
                            "(--rollout-batch-size x --n-samples-per-prompt)")
    stats = front.engine.reset_stats()
    num_tokens = sum(gather_lists([stats.num_generated_tokens], ranks))
    metrics = summarize(groups, {}, 0, len(groups), num_tokens, time.perf_counter() - started, reward_seconds,
                         stats)
    metrics.custom = {f"rollout/custom/{k}": float(v) for k, v in extra.items()}
    return RolloutBatch(groups=groups, metrics=metrics)
