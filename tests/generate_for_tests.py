"""Custom generate / rollout functions for the tests (--custom-generate-function-path tests.generate_for_tests.X)."""
from __future__ import annotations

import asyncio
import dataclasses

from furlong.types import Sample

TOOL_TOKENS = [40, 41, 42, 43, 44]   # a fixed 'tool output' (characters in the tiny tokenizer)


async def two_turns(args, sample, sampling_params):
    """Model turn, tool tokens, model turn: the second turn continues the first's KV."""
    params = dataclasses.replace(sampling_params, max_new_tokens=4, ignore_eos=True)
    async with args.engine.conversation(sampling_params.seed) as conv:
        first = await conv.generate(sample.tokens, params)
        sample.add_model_tokens(first.token_ids, first.log_probs, first.text)
        sample.add_tool_tokens(TOOL_TOKENS, "(tool)")
        second = await conv.generate(sample.tokens, params)
        sample.add_model_tokens(second.token_ids, second.log_probs, second.text)
    sample.status = Sample.Status.COMPLETED if second.finish_reason == "stop" else Sample.Status.TRUNCATED
    return sample


async def raises_on_group_0(args, sample, sampling_params):
    if sample.group_id == 0:
        raise RuntimeError("tool server unreachable")
    return await two_turns(args, sample, sampling_params)


async def hangs(args, sample, sampling_params):
    await asyncio.Event().wait()


async def wrong_type(args, sample, sampling_params):
    return {"tokens": sample.tokens}


async def too_long(args, sample, sampling_params):
    sample.add_tool_tokens([40] * 200, "x" * 200)
    return sample


def not_async(args, sample, sampling_params):
    return sample


def rollout_two_groups_each(args, rollout_id, data_source, evaluation=False):
    """--rollout-function-path: prompts from the data source, responses made without the engine."""
    from furlong.rollout.async_rollout import new_sample
    groups = []
    for gid, prompt in enumerate(data_source.next_batch(2)):
        group = []
        for j in range(2):
            s = new_sample(prompt, gid, j)
            s.add_model_tokens([50 + j, 2], [-0.5, -0.25], "ok")
            s.reward = float(j)
            group.append(s)
        groups.append(group)
    return groups
