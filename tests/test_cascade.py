"""Cascade decode attention on CPU: who is grouped, the exact reference, and the engine with it on/off.

The Triton kernel itself is checked against `cascade_attention_reference` in test_engine_gpu.py."""
from __future__ import annotations

import pytest
import torch

from furlong.engine import Engine, EngineConfig, Request, SamplingParams
from furlong.engine.block_manager import BlockManager
from furlong.engine.cascade import PrefixGroups, cascade_attention_reference, cascade_members, plan_groups
from furlong.engine.kv_cache import decode_attention_reference
from furlong.engine.sequence import new_sequences
from furlong.models.hf_io import load_pretrained
from tiny_checkpoints import write_tiny_checkpoint


def test_cascade_members_fill_the_query_tile():
    assert cascade_members(16, 8) == 8       # Qwen3-0.6B: 2 heads per KV head, 8 rows x 2 = 16
    assert cascade_members(32, 8) == 4
    assert cascade_members(28, 4) == 2       # group 7 pads to 16 rows: two members
    assert cascade_members(16, 16) == 16     # MHA
    assert cascade_members(64, 4) == 1       # group 16 fills the tile alone: nothing to share


def test_plan_groups_takes_unpreempted_forks_of_one_request_up_to_members():
    params = SamplingParams(temperature=0, max_new_tokens=4)
    a = new_sequences(Request(0, [1, 2, 3], params, n=5))
    b = new_sequences(Request(1, [4, 5], params, n=3))
    c = new_sequences(Request(2, [6], params, n=1))
    for group, forks in enumerate((a, b, c)):   # as the scheduler admits them: one fork group per prefill
        for s in forks:
            s.fork_group = group
    b[1].num_preemptions = 1                 # re-prefilled into its own pages: not grouped
    seqs = [a[0], b[0], a[1], c[0], b[1], a[2], a[3], b[2], a[4]]
    prefix_lens, groups, prefixes = plan_groups(seqs, members=3)
    # request 0's five rows: a group of 3 and one of 2; request 1: b0, b2 (b1 left out); c0 alone
    assert groups == [[0, 2, 5], [6, 8], [1, 7]]
    assert prefixes == [3, 3, 2]
    assert prefix_lens == [3, 2, 3, 0, 0, 3, 3, 2, 3]
    assert plan_groups(seqs, members=1) == ([0] * 9, [], [])      # cascade off
    assert plan_groups(seqs, members=2)[1] == [[0, 2], [5, 6], [1, 7]]   # a[4] would be alone
    lens, groups, _ = plan_groups(seqs, members=3, min_prefix=3)          # request 1's prompt is too short
    assert groups == [[0, 2, 5], [6, 8]] and lens == [3, 0, 3, 0, 0, 3, 3, 0, 3]
    lens, groups, _ = plan_groups(seqs, members=3, max_groups=2)          # the grid holds two: largest first
    assert groups == [[0, 2, 5], [6, 8]] and lens[1] == lens[7] == 0


def _forked_cache(prompt_len: int, own_lens: list[int], page: int = 4, hkv: int = 2, d: int = 8, seed: int = 0):
    """A paged cache laid out as the engine forks: one prompt prefilled into the first table, full
    pages shared, the partial last page copied; then each row's own tokens. -> keys, values, tables, lens."""
    g = torch.Generator().manual_seed(seed)
    bm = BlockManager(num_blocks=64, block_size=page)
    first: list[int] = []
    bm.grow(first, prompt_len)
    keys = torch.zeros(64, hkv, page, d, dtype=torch.float64)
    values = torch.zeros_like(keys)
    for j in range(prompt_len):
        keys[first[j // page], :, j % page] = torch.randn(hkv, d, generator=g, dtype=torch.float64)
        values[first[j // page], :, j % page] = torch.randn(hkv, d, generator=g, dtype=torch.float64)
    tables, copies = bm.fork(first, prompt_len, len(own_lens))
    for src, dst in copies:
        keys[dst], values[dst] = keys[src], values[src]
    for t, n in zip(tables, own_lens):
        bm.grow(t, prompt_len + n)
        for j in range(prompt_len, prompt_len + n):
            keys[t[j // page], :, j % page] = torch.randn(hkv, d, generator=g, dtype=torch.float64)
            values[t[j // page], :, j % page] = torch.randn(hkv, d, generator=g, dtype=torch.float64)
    width = max(len(t) for t in tables)
    tab = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor([prompt_len + n for n in own_lens], dtype=torch.int32)
    return keys, values, tab, lens


def test_cascade_reference_equals_plain_attention_and_reads_the_first_members_prompt():
    prompt, own = 10, [1, 5, 9, 3]                           # 10 tokens, page 4: two shared pages + a copied one
    keys, values, tables, lens = _forked_cache(prompt, own)
    q = torch.randn(4, 4, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    groups = PrefixGroups(torch.tensor([prompt] * 4, dtype=torch.int32),
                          torch.tensor([[0, 1, 2, 3]] + [[-1] * 4] * 3, dtype=torch.int32),
                          torch.tensor([prompt, 0, 0, 0], dtype=torch.int32))
    plain = decode_attention_reference(q, keys, values, tables, lens)
    torch.testing.assert_close(cascade_attention_reference(q, keys, values, tables, lens, groups), plain)
    # change row 2's copy of the last prompt token: plain attention sees it, cascade reads row 0's copy
    k2 = keys.clone()
    k2[tables[2, (prompt - 1) // 4], :, (prompt - 1) % 4] += 5.0
    assert not torch.allclose(decode_attention_reference(q, k2, values, tables, lens)[2], plain[2])
    torch.testing.assert_close(cascade_attention_reference(q, k2, values, tables, lens, groups), plain)
    # a row outside any group (prefix 0) reads its own pages
    alone = PrefixGroups(torch.tensor([prompt, prompt, 0, prompt], dtype=torch.int32),
                         torch.tensor([[0, 1, 3, -1]] + [[-1] * 4] * 3, dtype=torch.int32),
                         torch.tensor([prompt, 0, 0, 0], dtype=torch.int32))
    got = cascade_attention_reference(q, k2, values, tables, lens, alone)
    torch.testing.assert_close(got[2], decode_attention_reference(q, k2, values, tables, lens)[2])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3", vocab_size=128, hidden=64,
                                 layers=2, heads=4, kv_heads=2, seed=3)
    return load_pretrained(path, dtype=torch.float32, device="cpu")


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return ""


@pytest.mark.parametrize("kv_tokens", [2048, 112])          # 112: preemptions (re-prefilled rows leave groups)
def test_engine_with_cascade_samples_what_it_samples_without(model, kv_tokens):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 19, 8, 30)]
    params = SamplingParams(temperature=1.0, max_new_tokens=14, ignore_eos=True)

    def run(cascade: bool):
        eng = Engine(model, _Tok(), [], EngineConfig(page_size=8, decode_window=3, max_num_seqs=10,
                                                     cpu_kv_tokens=kv_tokens, max_model_len=64, cascade=cascade,
                                                     cascade_min_prefix=1))
        out = eng.generate([Request(i, p, params, n=1 + i % 4, seed=i) for i, p in enumerate(prompts)])
        return [[(c.token_ids, c.log_probs) for c in cs] for cs in out], eng.stats

    with_cascade, stats_on = run(True)
    without, stats_off = run(False)
    assert stats_on.num_grouped_rows > 0 and stats_off.num_grouped_rows == 0
    if kv_tokens == 112:
        assert stats_on.num_preemptions > 0
    for cs_a, cs_b in zip(with_cascade, without):
        for (ta, la), (tb, lb) in zip(cs_a, cs_b):
            assert ta == tb
            torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), atol=1e-5, rtol=0)


def test_plan_groups_joins_the_requests_of_one_shared_prefill():
    """Requests admitted on one shared prompt (scheduler.py sets their fork_group to the host's serial)
    read it as one group; another prefill of the same tokens is its own group."""
    params = SamplingParams(temperature=0, max_new_tokens=4)
    seqs = [new_sequences(Request(i, [1, 2, 3], params, n=1))[0] for i in range(5)]
    for s, group in zip(seqs, (7, 7, 7, 9, 9)):
        s.fork_group = group
    assert plan_groups(seqs, members=8)[1] == [[0, 1, 2], [3, 4]]
    seqs[1].num_preemptions = 1
    assert plan_groups(seqs, members=8)[1] == [[0, 2], [3, 4]]
