"""A custom-generate group's n conversations submit the same prompt as their first turn; the scheduler
prefills it once and forks its pages (scheduler.py, "Shared prompts"). Checked against the engine with
sharing off (EngineConfig.share_prompts=False, each request prefilled alone): the same tokens, token for
token, greedy and seeded sampling, through the real custom-generate group path (async_rollout.generate_group
via generate_eval_custom); prompt tokens prefilled drop by exactly (n - 1) x each prompt's length; the
joiners take no prefill budget (one prefill step where the unshared engine needs n); pages all come back;
decode reads a shared prompt once per group (cascade), with the same tokens."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoTokenizer

from furlong.engine import Engine, EngineConfig, SamplingParams
from furlong.engine.async_front import AsyncEngine
from furlong.models.hf_io import load_pretrained
from furlong.rollout.async_rollout import generate_eval_custom
from furlong.rollout.custom_generate import GenerateArgs, GenerateSpec
from furlong.types import Prompt, Sample
from generate_for_tests import two_turns
from tiny_checkpoints import write_tiny_checkpoint

N = 4
PROMPTS = [[5 + i] * length for i, length in enumerate((3, 8, 13, 21))]   # page size 8: inside, at, past a boundary


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("shared_prefill"), family="qwen3", vocab_size=128,
                                 hidden=64, layers=2, heads=4, kv_heads=2, seed=1)
    return load_pretrained(path, dtype=torch.float32, device="cpu"), AutoTokenizer.from_pretrained(path)


async def one_turn(args, sample, sampling_params):
    """The plainest custom generate: one `await engine.generate(prompt_ids, ...)` per sample."""
    turn = await args.engine.generate(sample.tokens, dataclasses.replace(sampling_params, ignore_eos=True),
                                      seed=sampling_params.seed)
    sample.add_model_tokens(turn.token_ids, turn.log_probs, turn.text)
    sample.status = Sample.Status.COMPLETED
    return sample


def run_groups(ckpt, fn, sampling: SamplingParams, share: bool, **kw):
    """Every prompt's N samples through `fn`; (per sample: response ids and log-probs, engine stats)."""
    model, tok = ckpt
    cfg = dict(page_size=8, decode_window=4, max_num_seqs=32, cpu_kv_tokens=4096, max_model_len=256,
               share_prompts=share)
    eng = Engine(model, tok, [2], EngineConfig(**{**cfg, **kw}))
    front = AsyncEngine(eng)
    args = GenerateArgs(engine=front, tokenizer=tok, max_context_len=256)
    prompts = [Prompt(row=i, raw="", text="", token_ids=p, label="") for i, p in enumerate(PROMPTS)]
    groups = generate_eval_custom(prompts, front, args, GenerateSpec(fn, fn.__name__, None, False),
                                  lambda s: 0.0, sampling, N, seed=7, ranks=None)
    stats = eng.reset_stats()
    blocks = eng.scheduler.blocks
    assert blocks.num_free == blocks.num_blocks - 1          # every page came back (conversations ended)
    return [[(s.response_ids, s.rollout_log_probs, s.loss_mask) for s in g.samples] for g in groups], stats


@pytest.mark.parametrize("fn", [two_turns, one_turn])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prompt_prefill_gives_the_same_tokens_and_prefills_each_prompt_once(ckpt, fn, temperature):
    sampling = SamplingParams(temperature=temperature, max_new_tokens=6)
    shared, s_stats = run_groups(ckpt, fn, sampling, share=True)
    alone, a_stats = run_groups(ckpt, fn, sampling, share=False)
    assert len(shared) == len(alone) == len(PROMPTS)
    for g_shared, g_alone in zip(shared, alone):
        for (ids, lps, mask), (ids0, lps0, mask0) in zip(g_shared, g_alone):
            assert ids == ids0 and mask == mask0
            assert lps == pytest.approx(lps0, abs=1e-5)
    if temperature > 0:   # seeded sampling: the n samples of a group differ, so each sampled on its own
        assert any(len({tuple(x[0]) for x in g}) > 1 for g in shared)
    saved = (N - 1) * sum(len(p) for p in PROMPTS)
    assert a_stats.num_prefill_tokens - s_stats.num_prefill_tokens == saved
    assert s_stats.num_generated_tokens == a_stats.num_generated_tokens


def test_joiners_take_no_prefill_budget(ckpt):
    """With a prefill budget of the longest prompt (21 tokens), sharing packs the prompts as if each group
    were one request: [3 + 8], [13], [21], three steps. Unshared, the N copies of every prompt each take
    budget: at least N x 45 / 21 -> 9 steps."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=3)
    budget = max(len(p) for p in PROMPTS)
    shared, s_stats = run_groups(ckpt, one_turn, sampling, share=True, max_prefill_tokens=budget)
    alone, a_stats = run_groups(ckpt, one_turn, sampling, share=False, max_prefill_tokens=budget)
    assert [[x[0] for x in g] for g in shared] == [[x[0] for x in g] for g in alone]
    assert s_stats.num_prefill_steps == 3
    assert a_stats.num_prefill_steps >= -(-N * sum(len(p) for p in PROMPTS) // budget)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prompts_decode_as_one_cascade_group(ckpt, temperature):
    """With cascade on for these short prompts (min prefix 8), the n conversations of a shared prompt are
    grouped in decode (as a request's n samples are); unshared they cannot be (n = 1 each); same tokens."""
    sampling = SamplingParams(temperature=temperature, max_new_tokens=6)
    shared, s_stats = run_groups(ckpt, one_turn, sampling, share=True, cascade_min_prefix=8)
    alone, a_stats = run_groups(ckpt, one_turn, sampling, share=False, cascade_min_prefix=8)
    assert a_stats.num_grouped_rows == 0 and s_stats.num_grouped_rows > 0
    for g_shared, g_alone in zip(shared, alone):
        for (ids, lps, mask), (ids0, lps0, mask0) in zip(g_shared, g_alone):
            assert ids == ids0 and mask == mask0
            assert lps == pytest.approx(lps0, abs=1e-5)


async def short_then_long(args, sample, sampling_params):
    """A one-token first turn (sampled by its prefill: no decode step), tool tokens, a 6-token second turn:
    every decode row belongs to a second turn."""
    async with args.engine.conversation(sampling_params.seed) as conv:
        first = await conv.generate(sample.tokens, dataclasses.replace(sampling_params, max_new_tokens=1,
                                                                       ignore_eos=True))
        sample.add_model_tokens(first.token_ids, first.log_probs, first.text)
        sample.add_tool_tokens([3, 4, 5], "(tool)")
        second = await conv.generate(sample.tokens, dataclasses.replace(sampling_params, ignore_eos=True))
        sample.add_model_tokens(second.token_ids, second.log_probs, second.text)
    sample.status = Sample.Status.COMPLETED
    return sample


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_later_turns_keep_reading_the_shared_prompt_as_one_group(ckpt, temperature):
    """A conversation's later turns keep its first turn's cascade group (retained.py): their decode rows
    are grouped, and their tokens are those of the engine without cascade."""
    sampling = SamplingParams(temperature=temperature, max_new_tokens=6)
    grouped, g_stats = run_groups(ckpt, short_then_long, sampling, share=True, cascade_min_prefix=8)
    plain, p_stats = run_groups(ckpt, short_then_long, sampling, share=True, cascade=False)
    assert p_stats.num_grouped_rows == 0
    # prompts of 8, 13 and 21 tokens reach the min prefix: their 3 x N conversations' second turns
    assert g_stats.num_grouped_rows >= 3 * N * 5 // 2
    for g_a, g_b in zip(grouped, plain):
        for (ids, lps, mask), (ids0, lps0, mask0) in zip(g_a, g_b):
            assert ids == ids0 and mask == mask0
            assert lps == pytest.approx(lps0, abs=1e-5)
