"""The asyncio engine front: dozens of multi-turn conversations (coroutines with a tool between turns)
share one continuous batch, and give exactly the tokens of one-at-a-time full re-prefills (greedy)."""
from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoTokenizer

from furlong.engine import Engine, EngineConfig, Request, SamplingParams
from furlong.engine.async_front import AsyncEngine
from furlong.models.hf_io import load_pretrained
from tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3af"), family="qwen3", vocab_size=128, hidden=32,
                                 layers=2, heads=2, kv_heads=1, seed=2)
    return load_pretrained(path, dtype=torch.float32, device="cpu"), AutoTokenizer.from_pretrained(path)


def engine(ckpt, **kw):
    model, tok = ckpt
    cfg = dict(page_size=8, decode_window=4, max_num_seqs=64, cpu_kv_tokens=8192, max_model_len=128)
    cfg.update(kw)
    return Engine(model, tok, [2], EngineConfig(**cfg))


GREEDY = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
NUM_CONVS, NUM_TURNS = 32, 3


def tool(conv: int, turn: int, reply: list[int]) -> list[int]:
    """A 'tool' whose output depends on what the model said (so a wrong turn would show later)."""
    return [10 + (sum(reply) + conv + 3 * turn + j) % 80 for j in range(4 + conv % 3)]


async def conversation(front: AsyncEngine, c: int) -> list[list[int]]:
    ids, turns = [5 + c % 50] * (2 + c % 11), []
    async with front.conversation(seed=c) as conv:
        for t in range(NUM_TURNS):
            turn = await conv.generate(ids, GREEDY)
            turns.append(turn.token_ids)
            await asyncio.sleep(0)                 # an async tool call
            ids = ids + turn.token_ids + tool(c, t, turn.token_ids)
    return turns


def test_concurrent_conversations_share_the_batch_and_match_reprefill(ckpt):
    eng = engine(ckpt)
    front = AsyncEngine(eng)

    async def main():
        return await asyncio.gather(*(conversation(front, c) for c in range(NUM_CONVS)))

    got = asyncio.run(front.serve(main()))
    stats = eng.reset_stats()
    assert stats.mean_batch > NUM_CONVS * 0.75          # the conversations decoded together
    assert stats.num_cached_tokens > 0
    assert eng.scheduler.blocks.num_used == 0 and not eng.scheduler.retained.parked

    ref_eng = engine(ckpt, max_num_seqs=1)              # one request at a time, whole prompt prefilled
    for c in range(NUM_CONVS):
        ids = [5 + c % 50] * (2 + c % 11)
        for t in range(NUM_TURNS):
            out = ref_eng.generate([Request(ref_eng.new_request_id(), ids, GREEDY, seed=c)])[0][0].token_ids
            assert out == got[c][t], (c, t)
            ids = ids + out + tool(c, t, out)


def test_context_cap_and_cancel_free_everything(ckpt):
    eng = engine(ckpt)
    front = AsyncEngine(eng, max_context_len=20)

    async def capped():
        async with front.conversation(seed=0) as conv:
            a = await conv.generate([7] * 17, SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True))
            b = await conv.generate([7] * 17 + a.token_ids, GREEDY)
        return a, b

    a, b = asyncio.run(front.serve(capped()))
    assert len(a.token_ids) == 3 and a.finish_reason == "length"      # 20 - 17 tokens of room
    assert b.token_ids == [] and b.finish_reason == "length"

    async def cancelled():
        async with front.conversation(seed=1) as conv:
            await asyncio.wait_for(conv.generate([9] * 5, SamplingParams(temperature=0, max_new_tokens=15,
                                                                        ignore_eos=True)), timeout=0.001)

    eng.reset_stats()
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(front.serve(cancelled()))
    assert eng.stats.num_prefill_steps == 1                 # it was running when it was cancelled
    assert not eng.has_work() and eng.scheduler.blocks.num_used == 0
