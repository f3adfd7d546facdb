"""Decode steps as two halves (overlap.py, ModelRunner.overlap_min_rows) on CPU: the halves run one after
the other here, so this checks what the GPU's two streams compute: each half's rows attend to their
own KV, at their own positions, through cascade groups planned within the half, and the joined hidden
states sample what the whole batch does. The GPU path (two streams inside captured graphs) is
test_engine_gpu.py's graph test with overlap_min_rows 2."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from furlong.engine import Engine, EngineConfig, Request, SamplingParams
from furlong.engine.overlap import run_halves
from furlong.models.hf_io import load_pretrained
from tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3", vocab_size=128, hidden=64,
                                 layers=2, heads=4, kv_heads=2, seed=0)
    return load_pretrained(path, dtype=torch.float32, device="cpu"), AutoTokenizer.from_pretrained(path)


def run(ckpt, overlap_min_rows: int, cascade_min_prefix: int, n: int):
    """(completions, [(lo, hi, cascade)] of every decode forward, [(cascade, halves, rows, the rows its
    split count was chosen for)] of every decode step) of one engine run: 5 prompts, n samples each."""
    model, tok = ckpt
    eng = Engine(model, tok, [], EngineConfig(page_size=8, decode_window=4, max_num_seqs=8, cpu_kv_tokens=2048,
                                             max_model_len=128, cascade_min_prefix=cascade_min_prefix))
    eng.runner.overlap_min_rows = overlap_min_rows
    calls, steps, split_rows = [], [], []
    hidden, step, num_splits = eng.runner._hidden, eng.runner._step, eng.runner.num_splits

    def spy(x, lo, hi, cascade, splits):
        calls.append((lo, hi, cascade))
        return hidden(x, lo, hi, cascade, splits)

    def step_spy(rows, truncate, cascade, splits, halves=False):
        steps.append((cascade, halves, rows, split_rows[-1]))
        return step(rows, truncate, cascade, splits, halves)

    def splits_spy(num_rows, padded_rows, longest, cascade):
        split_rows.append(padded_rows)
        return num_splits(num_rows, padded_rows, longest, cascade)
    eng.runner._hidden, eng.runner._step, eng.runner.num_splits = spy, step_spy, splits_spy
    texts = ("Hi", "What is 2 + 3?", "abc", "A longer prompt, several words.", "xyz" * 5)
    prompts = [tok(t)["input_ids"] for t in texts]
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=k, ignore_eos=True) for k in (5, 17, 11, 23, 9)]
    out = eng.generate([Request(i, p, q, n=n, seed=i) for i, (p, q) in enumerate(zip(prompts, params))])
    return out, calls, steps


def test_halves_sample_what_the_whole_batch_does(ckpt):
    whole, calls, _ = run(ckpt, 0, 1000, n=1)
    assert calls and all(lo == 0 for lo, _, _ in calls)
    halves, calls, steps = run(ckpt, 3, 1000, n=1)
    # a half's split count is a batch its size's (so either launch alone fills a GPU)
    assert all(split_rows == (rows // 2 if halves else rows) for _, halves, rows, split_rows in steps)
    # 5 running rows (halves of two and three), 4, 3 (one and two), then too few to split
    assert {(0, 2), (2, 5), (2, 4), (0, 1), (1, 3)} <= {(lo, hi) for lo, hi, _ in calls}
    assert {rows for *_, rows, _ in steps} == {5, 4, 3, 2, 1}
    assert all(halves == (rows >= 3) for _, halves, rows, _ in steps)
    for a, b in zip(whole, halves):
        for ca, cb in zip(a, b):
            assert ca.token_ids == cb.token_ids
            torch.testing.assert_close(torch.tensor(cb.log_probs), torch.tensor(ca.log_probs), atol=1e-5, rtol=0)


def test_halves_with_cascade_groups_sample_what_the_whole_batch_does(ckpt):
    """Every prompt shared by 2 samples (8 rows of 5 x 2 at first): grouped windows, each half planning
    its own groups, rows and group slots indexed within it."""
    whole, _, steps = run(ckpt, 0, 1, n=2)
    assert any(cascade for cascade, *_ in steps)
    halves, calls, steps = run(ckpt, 2, 1, n=2)
    assert any(cascade and halves for cascade, halves, *_ in steps)
    assert any(lo > 0 and cascade for lo, _, cascade in calls)              # the second half read through groups
    for a, b in zip(whole, halves):
        for ca, cb in zip(a, b):
            assert ca.token_ids == cb.token_ids
            torch.testing.assert_close(torch.tensor(cb.log_probs), torch.tensor(ca.log_probs), atol=1e-5, rtol=0)


def test_a_fork_group_across_the_split_makes_a_group_on_each_side(ckpt):
    from furlong.engine.cascade import GroupPlan
    from furlong.engine.sequence import new_sequences
    model, tok = ckpt
    runner = Engine(model, tok, [], EngineConfig(page_size=8, decode_window=4, max_num_seqs=8, cpu_kv_tokens=512,
                                                max_model_len=64, cascade_min_prefix=1)).runner
    params = SamplingParams(temperature=0, max_new_tokens=4)
    seqs = []
    for group, n in enumerate((3, 2, 3)):
        forks = new_sequences(Request(group, list(range(1, 10)), params, n=n))
        for s in forks:
            s.fork_group = group
        seqs += forks
    whole = runner._groups(seqs, 8, ("whole",), 0)
    assert [lo for lo, _ in whole] == [0] and whole[0][1].groups == [[0, 1, 2], [3, 4], [5, 6, 7]]
    parts = runner._groups(seqs, 8, ("halves",), 4)
    assert parts == [(0, GroupPlan([9, 9, 9, 0], [[0, 1, 2]], [9])),      # row 3 alone on its side
                     (4, GroupPlan([0, 9, 9, 9], [[1, 2, 3]], [9]))]      # rows 4 (alone), 5-7


def test_run_halves_without_a_side_stream_joins_in_order():
    out = run_halves(lambda: torch.tensor([[1.0], [2.0]]), lambda: torch.tensor([[3.0]]), None)
    assert out.tolist() == [[1.0], [2.0], [3.0]]

