"""A run's evaluation: every eval set (eval_set_map.py) through the engine, or all of them through
--eval-function-path; metrics eval/<name> (mean reward) plus --log-passrate / --log-reward-category's,
and each set's samples written to samples/eval_<name>_<k>.jsonl (rank 0), and all of them to
--save-debug-rollout-data's template with rollout_id eval_<k-1> (miles' names: the eval before training
is eval_0 too, so an eval after rollout 1 replaces its file, as in miles).

--eval-function-path is miles' eval rollout function, `fn(args, rollout_id, data_source, evaluation=True)`
(may be `async def`), returning {name: samples} where samples is a list of Sample, a list of groups, or
{"samples": [...], "rewards": [...]}, or an object with such a dict as `.data` (miles'
RolloutFnEvalOutput). Samples it leaves unrewarded get their set's reward (the training reward for a
name that is no eval set). Deviation from miles: `data_source` is the run's eval sets (rollout/eval.py
EvalSet: name, config, prompts), not the training data source; and it is used only when given, not
defaulted to --rollout-function-path.
"""
from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING, Any

from furlong.rollout.async_rollout import run_coroutine
from furlong.rollout.custom_generate import GenerateError
from furlong.rollout.rollout import reward_groups
from furlong.rollout.rollout_metrics import tool_call_ratio
from furlong.run.debug_data import save_rollout_rows
from furlong.run.metrics import write_samples
from furlong.run.reward_metrics import eval_reward_logs
from furlong.run.rollout_step import _front, eval_step
from furlong.types import Group, Sample

if TYPE_CHECKING:
    from furlong.run.setup import RunParts

FLAG = "--eval-function-path"


def run_evals(parts: RunParts, rollout_id: int) -> dict[str, float]:
    out: dict[str, float] = {}
    fns = parts.functions
    if fns is not None and fns.eval is not None:
        results = _custom_eval(parts, rollout_id)
    else:
        results = {}
        for es in parts.eval_sets:
            t = time.perf_counter()
            n = es.config.n_samples_per_prompt
            parts.logger.line(f"[eval {es.name}] generating {len(es.prompts)} prompts x {n} samples ...")
            res = eval_step(parts, es)   # frees the KV cache, as after a rollout
            parts.logger.line(f"[eval {es.name}] {res.score:.3f} ({res.num_samples} samples, "
                              f"{time.perf_counter() - t:.1f}s)")
            results[es.name] = (res.score, res.samples, n)
    template = parts.config.debug.save_rollout_data
    if template is not None and parts.ctx.rank == 0:   # every set in one file, as miles writes eval data
        save_rollout_rows(template, f"eval_{max(rollout_id, 0)}",
                          [s for _, samples, _ in results.values() for s in samples])
    for name, (score, samples, n) in results.items():
        out[f"eval/{name}"] = score
        out.update(eval_reward_logs(name, samples, n, parts.config.reward_logs))
        if (ratio := tool_call_ratio(samples)) is not None:
            out[f"eval/{name}/tool_call_ratio"] = ratio
        if parts.ctx.rank == 0:
            write_samples(parts.output_dir, name, rollout_id, samples)
    return out


def _flat(name: str, fn_name: str, value: Any) -> tuple[list[Sample], list[float] | None]:
    rewards = None
    if isinstance(value, dict):
        value, rewards = value.get("samples"), value.get("rewards")
    items = [s for x in value for s in (x if isinstance(x, list) else [x])] if isinstance(value, list) else None
    if items is None or not all(isinstance(s, Sample) for s in items):
        raise GenerateError(f"{FLAG}: {fn_name} returned {type(value).__name__} for eval set {name!r}, not a list "
                            "of furlong Samples (or of groups of them)")
    if rewards is not None and len(rewards) != len(items):
        raise GenerateError(f"{FLAG}: {fn_name}: eval set {name!r} has {len(items)} samples and {len(rewards)} "
                            "rewards")
    return items, rewards


def _custom_eval(parts: RunParts, rollout_id: int) -> dict[str, tuple[float, list[Sample], int]]:
    fns = parts.functions
    front, args = _front(parts, evaluation=True)
    try:
        try:
            out = fns.eval(args, rollout_id, parts.eval_sets, evaluation=True)
            if inspect.isawaitable(out):
                out = run_coroutine(front.serve(out))
        except GenerateError:
            raise
        except Exception as e:   # the user's code: one line naming it
            raise GenerateError(f"{FLAG}: {fns.eval_name} raised on eval {rollout_id + 1}: {type(e).__name__}: "
                                f"{e}".splitlines()[0]) from e
    finally:
        parts.engine.release()
    data = getattr(out, "data", out)
    if not isinstance(data, dict) or not data:
        raise GenerateError(f"{FLAG}: {fns.eval_name} returned {type(data).__name__}, not a dict of eval set name "
                            "-> samples")
    sets = {es.name: es for es in parts.eval_sets}
    results = {}
    for name, value in data.items():
        samples, rewards = _flat(str(name), fns.eval_name, value)
        es = sets.get(str(name))
        groups = [Group(group_id=g, samples=[s for s in samples if s.group_id == g])
                  for g in sorted({s.group_id for s in samples})]
        reward_groups(groups, es.reward_fn if es is not None else parts.reward_fn)
        scores = rewards if rewards is not None else [s.reward for s in samples]
        n = es.config.n_samples_per_prompt if es is not None else 1
        results[str(name)] = (sum(float(r) for r in scores) / max(len(scores), 1), samples, n)
    return results
