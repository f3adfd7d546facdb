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


# ------------------------------------------------ the calculator recipe with a scripted first call

SCRIPTED_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12345 * 6789"}}</tool_call><|im_end|>'


class _CallFirst:
    """A conversation whose first model turn is SCRIPTED_CALL (a tiny random model never writes a tool
    call) and whose later turns are the real engine's, continuing the same conversation."""

    def __init__(self, front, tokenizer, seed):
        self.inner, self.tokenizer, self.num_turns = front.conversation(seed), tokenizer, 0

    async def __aenter__(self):
        self.conv = await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self.inner.__aexit__(*exc)

    async def generate(self, token_ids, sampling):
        from furlong.engine.async_front import Turn
        self.num_turns += 1
        if self.num_turns > 1:
            return await self.conv.generate(token_ids, sampling)
        ids = self.tokenizer(SCRIPTED_CALL, add_special_tokens=False)["input_ids"]
        return Turn(ids, [0.0] * len(ids), SCRIPTED_CALL, "stop")


class _CallFirstFront:
    def __init__(self, front, tokenizer):
        self.front, self.tokenizer = front, tokenizer

    def conversation(self, seed):
        return _CallFirst(self.front, self.tokenizer, seed)


async def calculator_scripted_call(args, sample, sampling_params):
    """furlong.tools.calculator_generate.generate with the model's first turn scripted to call the
    calculator; every finished sample is recorded, with the rank that generated it, in
    <output-dir>/generated_rank<r>.jsonl (tests/test_custom_generate_ranks.py reads them)."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from furlong.tools import calculator_generate
    scripted = dataclasses.replace(args, engine=_CallFirstFront(args.engine, args.tokenizer))
    sample = await calculator_generate.generate(scripted, sample, sampling_params)
    if not args.evaluation:
        rank = dist.get_rank() if dist.is_initialized() else 0
        row = {"group": sample.group_id, "index": sample.index, "prompt_ids": sample.prompt.token_ids,
               "response_ids": sample.response_ids, "loss_mask": sample.loss_mask,
               "rollout_log_probs": sample.rollout_log_probs, "num_tool_calls": sample.metadata["num_tool_calls"]}
        with open(Path(args.config.log.output_dir) / f"generated_rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    return sample


RECORD_ENV = "FURLONG_TEST_BATCH_RECORD_DIR"


def record_batch_filter(group):
    """--dynamic-sampling-filter-path: keeps every group, and writes what this rank holds, in the order it
    holds it (every rank filters the gathered groups), to $FURLONG_TEST_BATCH_RECORD_DIR/batch_rank<r>.jsonl."""
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    row = {"group": group.group_id, "samples": [
        {"index": s.index, "tokens": s.tokens, "loss_mask": s.loss_mask, "reward": s.reward} for s in group.samples]}
    with open(Path(os.environ[RECORD_ENV]) / f"batch_rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    return True
