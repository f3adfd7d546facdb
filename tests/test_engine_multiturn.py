"""Multi-turn conversations in the engine: retained KV reused for the next turn gives, token for token,
what a full re-prefill of the whole conversation gives (greedy), under page boundaries, divergent
prompts, eviction of parked pages and preemption; pages all come back."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from furlong.engine import Engine, EngineConfig, Request, SamplingParams
from furlong.engine.block_manager import BlockManager
from furlong.engine.prefix_prefill import prefix_attention_reference
from furlong.engine.retained import RetainedKV
from furlong.engine.sequence import Sequence
from furlong.models.hf_io import load_pretrained
from tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3mt"), family="qwen3", vocab_size=128, hidden=64,
                                 layers=2, heads=4, kv_heads=2, seed=1)
    return load_pretrained(path, dtype=torch.float32, device="cpu"), AutoTokenizer.from_pretrained(path)


def engine(ckpt, **kw):
    model, tok = ckpt
    cfg = dict(page_size=8, decode_window=4, max_num_seqs=8, cpu_kv_tokens=2048, max_model_len=256)
    cfg.update(kw)
    return Engine(model, tok, [2], EngineConfig(**cfg))


def greedy(n):
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def tool_tokens(conv: int, turn: int, num: int) -> list[int]:
    """A deterministic 'tool output' that differs per conversation and turn."""
    return [10 + (conv * 7 + turn * 13 + j * 3) % 90 for j in range(num)]


def run_conversations(eng, prompts, turns, reuse: bool):
    """Every conversation's turns, interleaved: each turn of all conversations is in the engine at once.
    Returns per conversation the list of (tokens, log_probs) of each model turn."""
    convs = [list(p) for p in prompts]
    out = [[] for _ in prompts]
    last: dict[int, int] = {}
    for t, (num_new, num_tool) in enumerate(turns):
        ids = {}
        for c, ctx in enumerate(convs):
            rid = eng.new_request_id()
            ids[rid] = c
            eng.add(Request(rid, list(ctx), greedy(num_new), retain_kv=reuse,
                            continues=last.get(c) if reuse else None))
        while eng.has_work():
            for comp in eng.step():
                c = ids[comp.request_id]
                out[c].append((comp.token_ids, comp.log_probs))
                convs[c] += comp.token_ids + tool_tokens(c, t, num_tool)
                last[c] = comp.request_id
    eng.free(set(last.values()))
    return out


PROMPTS = [[5 + i] * (3 + 5 * i) for i in range(5)]     # 3 .. 23 tokens: several page offsets
TURNS = [(6, 5), (9, 8), (4, 0)]                          # (model tokens, then tool tokens) per turn


@pytest.mark.parametrize("kw", [dict(), dict(decode_window=1, page_size=4), dict(max_num_seqs=2),
                                dict(cpu_kv_tokens=160)])
def test_reused_kv_equals_full_reprefill(ckpt, kw):
    """Same tokens and log-probs as a fresh prefill of the whole conversation each turn; the cached
    tokens are really skipped; every page is back at the end. cpu_kv_tokens=160: the parked pages are
    evicted and running sequences preempted under pressure, and the answer stays the same."""
    ref = run_conversations(engine(ckpt, **kw), PROMPTS, TURNS, reuse=False)
    eng = engine(ckpt, **kw)
    got = run_conversations(eng, PROMPTS, TURNS, reuse=True)
    for a, b in zip(got, ref):
        assert [x[0] for x in a] == [x[0] for x in b]
        for (_, la), (_, lb) in zip(a, b):
            torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), atol=1e-4, rtol=0)
    assert eng.scheduler.blocks.num_used == 0 and not eng.scheduler.retained.parked
    if "cpu_kv_tokens" not in kw:
        assert eng.stats.num_cached_tokens > 0
        # every continuation prefilled only what was new: the tool tokens and the last sampled token
        new = sum(len(p) for p in PROMPTS) + sum(len(PROMPTS) * (1 + tool) for _, tool in TURNS[:-1])
        assert eng.stats.num_prefill_tokens == new


def test_no_cache_reference_and_divergent_continuation(ckpt):
    """A continuation whose prompt departs from the parked tokens mid-way reuses only the common
    prefix; both turns equal a no-cache greedy loop over the model."""
    model, _ = ckpt
    eng = engine(ckpt)
    prompt = list(range(20, 41))                           # 21 tokens: the second turn diverges inside page 2
    first = eng.generate([Request(0, prompt, greedy(7), retain_kv=True)])[0][0]
    second_prompt = prompt[:13] + [99, 98] + first.token_ids
    before = eng.stats.num_prefill_tokens
    second = eng.generate([Request(1, second_prompt, greedy(6), continues=0)])[0][0]
    assert eng.stats.num_prefill_tokens - before == len(second_prompt) - 13
    with torch.no_grad():
        ids = list(second_prompt)
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert second.token_ids == ids[len(second_prompt):]
    assert eng.scheduler.blocks.num_used == 0      # the second request did not retain: its pages went back


def test_shared_page_is_not_written_under_its_sharer():
    blocks = BlockManager(16, 4)
    kv = RetainedKV(blocks)
    table: list[int] = []
    blocks.grow(table, 10)                      # pages for 10 tokens: 3 pages
    req = Request(0, list(range(10)), greedy(1), retain_kv=True)
    old = Sequence(request=req, index=0, token_ids=list(range(12)), num_prompt_tokens=10, seed32=0,
                   block_table=table)
    assert kv.reusable(old, list(range(12)) + [50]) == 11       # all but the never-fed last token
    blocks.ref_counts[table[2]] += 1                             # position 11's page is shared
    assert kv.reusable(old, list(range(12)) + [50]) == 8         # back to the page boundary
    assert kv.reusable(old, [0, 1, 2, 7]) == 3                   # divergence at 3 (its page 0 is not shared)
    kv.park(old)
    seq = kv.continuation(Request(1, [0, 1, 2, 7], greedy(1), continues=0))
    assert seq.num_cached == 3 and len(seq.block_table) == 1 and not kv.parked
    assert blocks.num_used == 2                  # page 0 kept by the continuation, page 2 by its other sharer


def test_continuations_keep_their_cascade_group_only_while_they_hold_its_pages():
    """A later turn inherits its first turn's fork group and the part of the shared prompt it still holds;
    one whose parked pages are gone, or that is preempted, holds none (its KV is recomputed)."""
    blocks = BlockManager(16, 4)
    kv = RetainedKV(blocks)
    table: list[int] = []
    blocks.grow(table, 12)
    old = Sequence(request=Request(0, list(range(10)), greedy(1), retain_kv=True), index=0,
                   token_ids=list(range(12)), num_prompt_tokens=10, seed32=0, block_table=table, fork_group=7,
                   shared_prefix=10)
    kv.park(old)
    seq = kv.continuation(Request(1, list(range(12)) + [50], greedy(1), continues=0))
    assert (seq.fork_group, seq.shared_prefix, seq.num_cached) == (7, 10, 11)
    kv.park(seq)
    short = kv.continuation(Request(2, [0, 1, 2, 9], greedy(1), continues=1))   # diverges inside the prompt
    assert (short.fork_group, short.shared_prefix) == (7, 3)
    gone = kv.continuation(Request(3, list(range(12)), greedy(1), continues=99))   # nothing parked under 99
    assert gone.shared_prefix == 0 and gone.num_cached == 0


def test_prefix_attention_reference_matches_full_causal():
    """Queries at the end of a longer key row == the same rows of full causal attention."""
    torch.manual_seed(0)
    q, k, v = torch.randn(11, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    full = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                            v.transpose(0, 1), is_causal=True,
                                                            enable_gqa=True).transpose(0, 1)
    got = prefix_attention_reference(q[7:], k, v, [0, 4], [0, 11])
    torch.testing.assert_close(got, full[7:])


def test_retained_requests_need_n_1(ckpt):
    with pytest.raises(ValueError, match="n = 1"):
        engine(ckpt).add(Request(0, [3, 4], greedy(2), n=2, retain_kv=True))


def _prefix_prefill_against_reference(dev: torch.device, dtype: torch.dtype, kv_dtype: str, atol: float) -> None:
    """Three items (a continuation past a page boundary, a new prompt, a short continuation) through the
    context's gather out of a paged cache (fp8: dequantised, the new tokens' own rows unquantised),
    against the reference over K/V built here from the same cache contents."""
    from furlong.engine.kv_cache import KVLayout, PagedKVCache, PrefillContext
    from furlong.engine.kv_fp8 import FP8, dequantize, quantize
    from furlong.engine.prefix_prefill import prefix_prefill_context
    from furlong.engine.plan import PrefillItem
    torch.manual_seed(0)
    page, fp8 = 16, kv_dtype == "fp8_e4m3"
    lay = KVLayout(num_layers=1, num_kv_heads=2, page_size=page, head_dim=64, dtype=FP8 if fp8 else dtype, scaled=fp8)
    (k_data, k_scales), (v_data, v_scales) = (lay.views(torch.zeros(12 * lay.page_bytes, dtype=torch.uint8,
                                                                    device=dev), 12) for _ in range(2))
    for data, scales in ((k_data, k_scales), (v_data, v_scales)):   # cached prefixes: random, as stored
        x = torch.randn(data.shape, device=dev, dtype=dtype)
        if fp8:
            data[:], scales[:] = quantize(x)
        else:
            data[:] = x
    cache = PagedKVCache(k_data, v_data, k_scales, v_scales)
    seqs = [Sequence(request=Request(i, [1], greedy(1)), index=0, token_ids=[1], num_prompt_tokens=1, seed32=0,
                     block_table=t) for i, t in enumerate([[3, 5, 7], [2, 9], [4]])]
    items = [PrefillItem([seqs[0]], [0] * 5, [], start=33), PrefillItem([seqs[1]], [0] * 20, [], start=0),
             PrefillItem([seqs[2]], [0] * 3, [], start=9)]
    pages, offs, cu = [], [], [0]
    for it in items:
        for i in range(it.start, it.start + len(it.token_ids)):
            pages.append(it.sequences[0].block_table[i // page])
            offs.append(i % page)
        cu.append(cu[-1] + len(it.token_ids))
    new = PrefillContext(cache, torch.tensor(pages, device=dev), torch.tensor(offs, device=dev),
                         torch.tensor(cu, device=dev, dtype=torch.int32), 20)
    ctx = prefix_prefill_context(new, items, dev)
    q = torch.randn(cu[-1], 4, 64, device=dev, dtype=dtype)
    k = torch.randn(cu[-1], 2, 64, device=dev, dtype=dtype)
    v = torch.randn(cu[-1], 2, 64, device=dev, dtype=dtype)
    got = ctx.attend(0, q, k, v)
    c = cache.layer(0)
    at = (ctx.key_page, slice(None), ctx.key_offset)
    kk, vv = c.keys[at].float(), c.values[at].float()
    if fp8:
        kk, vv = dequantize(c.keys[at], c.key_scales[at], torch.float32), dequantize(c.values[at], c.value_scales[at],
                                                                                    torch.float32)
    own = [j for i in range(3) for j in range(ctx.key_bounds[i + 1] - len(items[i].token_ids), ctx.key_bounds[i + 1])]
    kk[own], vv[own] = k.float(), v.float()       # every prefill attends over its own tokens unquantised
    want = prefix_attention_reference(q.float(), kk, vv, ctx.query_bounds, ctx.key_bounds)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_prefix_prefill_context_reads_the_cache_on_cpu(kv_dtype):
    _prefix_prefill_against_reference(torch.device("cpu"), torch.float32, kv_dtype, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_prefix_prefill_flash_matches_reference_on_gpu(kv_dtype):
    """The flash varlen path (bottom-right causal alignment when keys outnumber queries) against the
    reference; the fp8 cache written by the Triton store."""
    _prefix_prefill_against_reference(torch.device("cuda"), torch.bfloat16, kv_dtype, atol=2e-2)


def test_decode_rows_of_a_prompt_group_sit_side_by_side(ckpt):
    """Continuations rejoin in the order their turns ended; decode still runs a group's rows adjacent (the
    kernel's row-major programs then read the group's shared prompt pages from L2)."""
    eng = engine(ckpt)
    plans = []
    prompts = {0: [5] * 12, 1: [9] * 12}
    first = {}
    for conv in (0, 1, 2, 3):                  # conversations 0, 2 share prompt 0; 1, 3 share prompt 1
        rid = eng.new_request_id()
        first[conv] = rid
        eng.add(Request(rid, prompts[conv % 2], greedy(3), retain_kv=True))
    sched = eng.scheduler
    original = sched.schedule

    def spy():
        plan = original()
        if plan is not None and plan.decode:
            plans.append([s.fork_group for s in plan.decode])
        return plan
    sched.schedule = spy
    done = {}
    while eng.has_work():
        for comp in eng.step():
            done[comp.request_id] = comp.token_ids
    assert plans and all(len(set(p)) == 2 for p in plans)
    for conv in (3, 0, 1, 2):                  # next turns arrive interleaved across the groups
        ctx = prompts[conv % 2] + done[first[conv]] + [7, 8]
        eng.add(Request(eng.new_request_id(), ctx, greedy(3), retain_kv=True, continues=first[conv]))
    plans.clear()
    while eng.has_work():
        eng.step()
    assert plans
    for groups in plans:
        assert groups == sorted(groups), groups          # each group's rows contiguous
