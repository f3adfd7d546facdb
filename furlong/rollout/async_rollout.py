"""The rollout and eval with a custom generate function (custom_generate.py): coroutines, one batch.

The same streaming over-sampling as rollout.py, with a coroutine per sample instead of an engine
request per group: whenever the groups kept plus those in flight fall short of the batch, the next
`over_sampling_batch_size` prompts start, n coroutines each (this rank's share); the loop steps
the engine (AsyncEngine.tick: one step, then every woken coroutine runs to its next await), then
takes the groups whose n samples are done, rewards the samples that have no reward yet, exchanges
the finished groups between ranks (every rank ticks in step, so the collective lines up), and
filters them. Once the batch is kept, the coroutines still running are cancelled: their engine
requests are aborted and their conversations' pages freed.

A sample's seed is derive_seed(rollout seed, rollout id, group id, index), so its draws depend on
neither the rank count nor the batching. A failed sample (GenerateError) stops the run, or with
drop_failed drops its group, counted.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections import Counter
from typing import Any, Callable, Coroutine

from furlong.engine.async_front import AsyncEngine
from furlong.rollout.custom_generate import GenerateArgs, GenerateError, GenerateSpec, run_generate
from furlong.rollout.filters import GroupFilter
from furlong.rollout.rollout import (RolloutBatch, RolloutError, RolloutConfig, derive_seed, gather_lists,
                                     rank_share, reward_groups)
from furlong.rollout.rollout_metrics import summarize
from furlong.types import DistContext, Group, Prompt, Sample


def run_coroutine(coro: Coroutine[Any, Any, Any]) -> Any:
    """asyncio.run, also from inside a running loop (a notebook): then on a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def new_sample(prompt: Prompt, group_id: int, index: int) -> Sample:
    return Sample(prompt=prompt, group_id=group_id, index=index, response_ids=[], response_text="",
                  rollout_log_probs=[], finish_reason=Sample.Status.PENDING.value, metadata=dict(prompt.metadata))


async def generate_group(gen: GenerateSpec, args: GenerateArgs, prompt: Prompt, group_id: int, n: int,
                         sampling: Any, seed_parts: tuple[int, ...]) -> Group | int:
    """The group's n samples; with drop_failed, the number of failed samples instead of a group."""
    async def one(j: int) -> Sample | None:
        params = dataclasses.replace(sampling, seed=derive_seed(*seed_parts, group_id, j))
        try:
            return await run_generate(gen, args, new_sample(prompt, group_id, j), params)
        except GenerateError:
            if not gen.drop_failed:
                raise
            return None
    samples = await asyncio.gather(*(one(j) for j in range(n)))
    failed = sum(s is None for s in samples)
    return failed if failed else Group(group_id=group_id, samples=list(samples))


def generate_rollout_custom(dataset: Any, front: AsyncEngine, args: GenerateArgs, gen: GenerateSpec,
                            reward_fn: Callable[[Sample], Any], filter_fn: GroupFilter | None, cfg: RolloutConfig,
                            ranks: DistContext | None, rollout_id: int) -> RolloutBatch:
    return run_coroutine(_rollout(dataset, front, args, gen, reward_fn, filter_fn, cfg, ranks, rollout_id))


async def _rollout(dataset: Any, front: AsyncEngine, args: GenerateArgs, gen: GenerateSpec,
                   reward_fn: Callable[[Sample], Any], filter_fn: GroupFilter | None, cfg: RolloutConfig,
                   ranks: DistContext | None, rollout_id: int) -> RolloutBatch:
    started = time.perf_counter()
    front.engine.reset_stats()
    target, per_batch, n = cfg.rollout_batch_size, cfg.over_sampling_batch_size, cfg.n_samples_per_prompt
    limit = max(len(dataset), target)
    kept: list[Group] = []
    dropped: Counter[str] = Counter()
    tasks: list[asyncio.Task] = []
    in_flight = consumed = num_finished = num_late = num_failed = 0   # counts over all ranks
    reward_seconds = 0.0
    try:
        while len(kept) < target:
            while len(kept) + in_flight < target and consumed < limit:
                prompts = dataset.next_batch(per_batch)
                share = rank_share(len(prompts), ranks)
                for i in range(share.start, share.stop):
                    tasks.append(asyncio.ensure_future(generate_group(
                        gen, args, prompts[i], consumed + i, n, cfg.sampling, (cfg.seed, rollout_id))))
                consumed += len(prompts)
                in_flight += len(prompts)
            if in_flight == 0:
                raise RolloutError(f"dynamic sampling filter kept {len(kept)}/{target} groups after a full pass over "
                                   f"{consumed} prompts (data set has {len(dataset)}); rewards may all be equal")
            await front.tick()
            done = [t for t in tasks if t.done()]
            tasks = [t for t in tasks if not t.done()]
            results = [t.result() for t in done]      # a GenerateError (stop on error) ends the run here
            groups = [g for g in results if isinstance(g, Group)]
            t0 = time.perf_counter()
            reward_groups(groups, reward_fn)
            reward_seconds += time.perf_counter() - t0
            finished = gather_lists([g if isinstance(g, Group) else int(g) for g in results], ranks)
            in_flight -= len(finished)
            num_finished += len(finished)
            for g in finished:
                if not isinstance(g, Group):
                    num_failed += g
                    dropped["custom_generate_failed"] += 1
                elif len(kept) >= target:
                    num_late += 1
                elif filter_fn is not None and not filter_fn(g):
                    dropped[filter_fn.name] += 1
                else:
                    kept.append(g)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)   # cancelled turns abort their requests
    num_aborted = in_flight + num_late
    stats = front.engine.reset_stats()
    num_tokens = sum(gather_lists([stats.num_generated_tokens], ranks))
    metrics = summarize(kept, dict(dropped), num_aborted, num_finished, num_tokens, time.perf_counter() - started,
                         reward_seconds, stats, num_failed=num_failed)
    return RolloutBatch(groups=kept, metrics=metrics)


def generate_eval_custom(prompts: list[Prompt], front: AsyncEngine, args: GenerateArgs, gen: GenerateSpec,
                         reward_fn: Callable[[Sample], Any], sampling: Any, n: int, seed: int,
                         ranks: DistContext | None) -> list[Group]:
    """Every prompt's n samples through the custom function (this rank's share), rewarded, gathered in
    prompt order; failed groups are left out (drop) or end the run (stop)."""
    mine = rank_share(len(prompts), ranks)

    async def main() -> list[Group | int]:
        work = asyncio.gather(*(generate_group(gen, args, prompts[i], i, n, sampling, (seed,))
                                for i in range(mine.start, mine.stop)))
        return await front.serve(work)

    groups = [g for g in run_coroutine(main()) if isinstance(g, Group)]
    reward_groups(groups, reward_fn)
    return gather_lists(groups, ranks)
