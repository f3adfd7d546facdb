"""The `rlstep` bench part: the real RL step as `furlong train` takes it, without and with --partial-rollout.

K = `rl_step_probe.num_steps` steps of run/step.py's `rl_step` run with --partial-rollout, then steps
2..K again without it, on the same warm engine and actor and from the prompt position where partial
step 2 began (`_run_both`): the streaming rollout (over-sampling by `over_sampling_batch_size`
groups, the zero-std dynamic filter, abort or pause once `rollout_batch_size` groups are kept),
shaping, advantages, the actor's train step and the weight sync into the engine. The engine and the
actor are built from the workload as run set-up builds them (engine_config, the memory plan's budget).

Random weights never emit EOS, so lengths are forced as in the `rollout` part: every sample stops at
its own length, the workload's response_lens dealt to the prompts of a pool (`num_prompts` x 8 prompts
with the workload's prompt lengths; each pass over them re-deals the lengths in a seeded order, so
groups differ in their longest sample). `ForcedLengths` sets a request's per-sample max_new_tokens
from its prompt; a resumed sample keeps its forced total. Rewards are synthetic and fixed per
(prompt, sample): every `zero_std_every`-th prompt's group gets equal rewards, so the filter drops
it; the others vary within the group.

Step 1 pays the compiles and CUDA-graph captures, and is the same rollout in both modes up to its
end (abort vs pause), so it runs once; partial rollouts pay off only from the 2nd step on (paused
groups resume with a head start), so the summary compares steps 2..K, and a call saves a warm-up
and a step against running each mode from scratch (the long workload's steps take minutes).
Each step prints a line as it ends, so a run cut by the time guard still shows what it measured.
"""
from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import torch

from furlong.bench.measure import free_memory, sync
from furlong.bench.report import RlStepResult
from furlong.bench.state import Bench, NullTokenizer
from furlong.types import Prompt, Sample

FILTER = "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
POOL_PASSES = 8     # prompts in the pool: the workload's prompts this many times over


class ForcedLengths:
    """The engine, with each request's samples stopped at the lengths `forced` holds for its prompt."""

    def __init__(self, engine: Any, forced: dict[tuple[int, ...], list[int]]):
        self.engine, self.forced = engine, forced

    def add(self, request: Any) -> None:
        lens = self.forced[tuple(request.prompt_ids)]
        k = request.first_sample       # a resumed sample: its own forced total (resumed tokens included)
        self.engine.add(dataclasses.replace(request, sample_max_new_tokens=lens[k:k + request.n]))

    def __getattr__(self, name: str) -> Any:     # the rest of the engine's interface, unchanged
        return getattr(self.engine, name)


class PromptPool:
    """The pool's prompts in order, cycling, as furlong.data.PromptDataset serves an unshuffled data set."""

    def __init__(self, prompts: list[Prompt]):
        self.prompts, self.position = prompts, 0

    def __len__(self) -> int:
        return len(self.prompts)

    def next_batch(self, num: int) -> list[Prompt]:
        out = [self.prompts[(self.position + k) % len(self.prompts)] for k in range(num)]
        self.position += num
        return out


def prompt_pool(b: Bench) -> tuple[list[Prompt], dict[tuple[int, ...], list[int]]]:
    """The pool (module docstring) and each prompt's forced response lengths [n]."""
    w, n = b.w, b.w.n_samples_per_prompt
    g = torch.Generator().manual_seed(b.seed + 5)
    rng = np.random.default_rng(b.seed + 5)
    prompts, forced = [], {}
    for p in range(POOL_PASSES):
        order = rng.permutation(len(w.response_lens)) if p else np.arange(len(w.response_lens))
        for i, plen in enumerate(w.prompt_lens):
            row = p * len(w.prompt_lens) + i
            ids = torch.randint(0, b.args.vocab_size, (plen,), generator=g).tolist()
            prompts.append(Prompt(row=row, raw="", text="", token_ids=ids, label=""))
            forced[tuple(ids)] = [w.response_lens[int(order[i * n + j])] for j in range(n)]
    if len(forced) != len(prompts):
        raise RuntimeError("bench rlstep: two random prompts coincide; their forced lengths would be confused")
    return prompts, forced


def synthetic_reward(every: int):
    def reward(sample: Sample) -> float:
        return 0.0 if sample.prompt.row % every == every - 1 else float(sample.index % 2)
    return reward


def _run_steps(parts: Any, b: Bench, name: str, first_id: int, num: int) -> dict[str, list[Any]]:
    """`num` steps of rl_step from rollout id `first_id`, each printed as it ends."""
    from furlong.run.step import StageClock, rl_step
    out: dict[str, list[Any]] = {k: [] for k in ("step_s", "rollout_s", "train_s", "generated", "trained", "aborted",
                                                 "resumed", "paused", "offpolicy")}
    for rollout_id in range(first_id, first_id + num):
        clock = StageClock()
        step = rl_step(parts, rollout_id, clock)
        sync(b.device)
        m = step.metrics
        vals = (clock.elapsed(), m["perf/rollout_time"], clock.seconds.get("perf/actor_train_time", 0.0),
                step.batch.metrics.num_generated_tokens, sum(len(s.response_ids) for s in step.batch.samples),
                step.batch.metrics.num_aborted, m.get("rollout/partial/num_resumed", 0.0),
                m.get("rollout/partial/num_paused", 0.0), m.get("rollout/partial/offpolicy_token_frac", 0.0))
        for key, v in zip(out, vals):
            out[key].append(v)
        print(f"[bench] rlstep {name} step {rollout_id + 1}: {vals[0]:.2f}s (rollout {vals[1]:.2f}s, train "
              f"{vals[2]:.2f}s), generated {vals[3]} tokens, trained {vals[4]}, aborted groups {vals[5]}, resumed "
              f"{vals[6]:.0f} samples, paused {vals[7]:.0f}", flush=True)
    return out


def _run_both(b: Bench) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """K steps with --partial-rollout, then K - 1 plain steps (rollout ids 2..K again) on the same warm engine
    and actor, from the prompt position partial step 2 started at and with the paused groups dropped: step 1
    is the same rollout in both modes up to its end (abort vs pause), so it runs once, and both modes' steps
    2 draw new prompts in the same order from the same position (plain draws more: partial fills part of
    its over-sampled batch with the paused groups). With forced lengths and synthetic rewards a step's
    work does not depend on the weights' values, so the actor having trained K more steps changes no
    timing."""
    from furlong.config_map import engine_config, run_config
    from furlong.engine import Engine
    from furlong.rollout.filters import load_filter
    from furlong.rollout.partial import PausedGroups
    from furlong.run.setup import RunParts
    from furlong.trainer.mfu import model_flops_per_token
    w = b.w
    b.release_actor()                          # a fresh, seeded actor
    actor = b.actor()
    cfg = b.config()
    r = cfg.rollout
    r.num_rollout, r.over_sampling_batch_size, r.dynamic_sampling_filter_path = (w.rlstep_num_steps,
                                                                                 w.rlstep_over_sampling, FILTER)
    r.partial_rollout, r.rollout_kv_dtype = True, b.kv_dtype
    config = run_config(cfg)
    if b.plan is not None:
        config = config.with_max_tokens(b.plan.max_tokens_per_gpu)
    prompts, forced = prompt_pool(b)
    pool = PromptPool(prompts)
    model = b.random_model().to(b.dtype).eval()   # the engine's copy of the same initial weights
    engine = Engine(model, NullTokenizer(), [], engine_config(cfg, max(w.prompt_lens) + max(w.response_lens)))
    # RunParts as run set-up makes it, less what rl_step never reads (outputs, eval sets)
    parts = RunParts(config=config, ctx=b.ctx, output_dir=Path("."), logger=None, dataset=pool,
                     eval_sets=[], engine=ForcedLengths(engine, forced),
                     reward_fn=synthetic_reward(w.rlstep_zero_std_every),
                     filter_fn=load_filter(FILTER), actor=actor, start_rollout=0,
                     train_flops_per_token=model_flops_per_token(actor.model), paused=PausedGroups())
    k = w.rlstep_num_steps
    part = _run_steps(parts, b, "partial", 0, 1)
    branch = pool.position                     # where both modes' step 2 starts drawing new prompts
    rest = _run_steps(parts, b, "partial", 1, k - 1)
    part = {key: part[key] + rest[key] for key in part}
    parts.paused, pool.position = None, branch    # plain: unfinished groups are aborted (rollout.py)
    plain = _run_steps(parts, b, "plain", 1, k - 1)
    engine.release()
    del parts, engine, model, actor   # the actor too: release_actor reports what is still allocated
    b.release_actor()
    free_memory(b.device)
    return plain, part


def _mean(times: list[float]) -> float | None:
    return statistics.mean(times) if times else None


def _after_first(times: list[float]) -> float | None:
    return _mean(times[1:])


def part_rlstep(b: Bench) -> RlStepResult:
    w = b.w
    plain, part = _run_both(b)
    p1, p2 = _mean(plain["step_s"]), _after_first(part["step_s"])
    return RlStepResult(
        num_steps=w.rlstep_num_steps, rollout_batch_size=len(w.prompt_lens),
        over_sampling_batch_size=w.rlstep_over_sampling, n_samples_per_prompt=w.n_samples_per_prompt,
        plain_step_s=plain["step_s"], plain_rollout_s=plain["rollout_s"], plain_train_s=plain["train_s"],
        plain_generated_tokens=plain["generated"], plain_trained_tokens=plain["trained"],
        plain_aborted_groups=plain["aborted"], plain_resumed_samples=[int(x) for x in plain["resumed"]],
        partial_step_s=part["step_s"], partial_rollout_s=part["rollout_s"], partial_train_s=part["train_s"],
        partial_generated_tokens=part["generated"], partial_trained_tokens=part["trained"],
        partial_aborted_groups=part["aborted"], partial_resumed_samples=[int(x) for x in part["resumed"]],
        partial_paused_samples=[int(x) for x in part["paused"]], partial_offpolicy_token_frac=part["offpolicy"],
        plain_step_s_after_first=p1, partial_step_s_after_first=p2,
        partial_speedup=None if p1 is None or p2 is None else p1 / p2, offload_weights=b.offload_weights,
        note=f"rl_step as furlong train runs it; forced lengths; every {w.rlstep_zero_std_every}th group filtered "
             "(equal rewards); partial step 1 includes compiles and graph captures and is not compared; plain "
             "steps 2..K rerun partial's steps 2..K on the same warm engine and actor from the same prompt "
             "position, paused groups dropped; speedup over steps 2..K")
