"""Rollout: filter registry, over-sampling with the dynamic filter, eval, data-parallel rollout (gloo)."""
from __future__ import annotations

import socket
from collections import Counter

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp

from furlong.rollout.eval import run_eval
from furlong.rollout.filters import check_reward_nonzero_std, load_filter
from furlong.rollout.generator import Generation
from furlong.rollout.rollout import RankInfo, RolloutError, RolloutSpec, generate_rollout, rank_share
from furlong.rollout.sampling import SamplingParams
from furlong.types import Group, Prompt, Sample

FILTER = "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"


class FakeDataset:
    """`num` prompts in a fixed order, served in epochs like furlong.data.PromptDataset."""

    def __init__(self, num: int):
        self.prompts = [Prompt(row=i, raw=f"q{i}", text=f"q{i}", token_ids=[i, 7, 7], label=str(i)) for i in range(num)]
        self.position = 0

    def __len__(self) -> int:
        return len(self.prompts)

    def next_batch(self, num: int) -> list[Prompt]:
        out = [self.prompts[(self.position + k) % len(self.prompts)] for k in range(num)]
        self.position += num
        return out


class FakeGenerator:
    """Scripted engine: the k-th copy of a prompt within one call answers 'row:k'."""

    def __init__(self, max_len: int = 4):
        self.calls: list[tuple[list[int], int | None]] = []   # (prompt rows, seed) per call
        self.max_len = max_len

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self.calls.append(([p[0] for p in prompts], params.seed))
        seen: Counter[int] = Counter()
        out = []
        for p in prompts:
            row, k = p[0], seen[p[0]]
            seen[row] += 1
            n = 1 + (row + k) % self.max_len            # response length 1..max_len
            out.append(Generation(token_ids=[row] * n, log_probs=[-0.5] * n, text=f"{row}:{k}",
                                  finish_reason="length" if n == self.max_len else "stop"))
        return out


def scripted_reward(sample: Sample) -> float:
    """Even rows: every sample gets 0 (zero std, dropped). Odd rows: the sample index."""
    row, k = map(int, sample.response_text.split(":"))
    return 0.0 if row % 2 == 0 else float(k)


def spec(batch: int, over: int, n: int = 2, seed: int = 3) -> RolloutSpec:
    return RolloutSpec(rollout_batch_size=batch, n_samples_per_prompt=n, over_sampling_batch_size=over,
                       sampling=SamplingParams(temperature=1.0, max_new_tokens=4), seed=seed)


def _group(rewards):
    p = Prompt(row=0, raw="", text="", token_ids=[1], label="")
    return Group(0, [Sample(p, 0, i, [1], "", [0.0], "stop", reward=r) for i, r in enumerate(rewards)])


def test_filter_registry():
    for path in (FILTER, "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
                 "furlong.rollout.filters.check_reward_nonzero_std"):
        f = load_filter(path)
        assert f.fn is check_reward_nonzero_std and f.name == "zero_std"
    assert load_filter(None) is None
    user = load_filter("operator.truth")
    assert user.name == "truth" and user(_group([1.0])) is True
    for bad, why in (("no_such_pkg_xyz.mod.fn", "cannot import"), ("os.path.no_such_fn", "no callable"),
                     ("nodots", "dotted path")):
        with pytest.raises(ValueError, match=f"--dynamic-sampling-filter-path: .*{why}"):
            load_filter(bad)
    assert check_reward_nonzero_std(_group([0.0, 1.0])) is True
    assert check_reward_nonzero_std(_group([1.0, 1.0, 1.0])) is False
    assert check_reward_nonzero_std(_group([0.5])) is False


def test_over_sampling_keeps_exact_count_and_counts_drops():
    # rounds of 5 prompts: rows 0-4 keep 1,3; rows 5-9 keep 5,7 then 9 is aborted; evens dropped
    gen = FakeGenerator()
    batch = generate_rollout(FakeDataset(20), gen, scripted_reward, load_filter(FILTER), spec(4, 5), None, 0)
    assert [g.samples[0].prompt.row for g in batch.groups] == [1, 3, 5, 7]
    assert [g.group_id for g in batch.groups] == [1, 3, 5, 7]
    assert all([s.index for s in g.samples] == [0, 1] for g in batch.groups)
    m = batch.metrics
    assert (m.num_dropped, m.num_aborted, m.num_generated_groups, m.num_rounds) == ({"zero_std": 5}, 1, 10, 2)
    assert m.raw_reward == 0.5
    lens = [len(s.response_ids) for g in batch.groups for s in g.samples]
    assert m.response_len_mean == sum(lens) / 8 and m.response_len_max == max(lens)
    assert m.truncated_ratio == sum(n == 4 for n in lens) / 8
    assert m.rollout_log_probs == -0.5 and m.num_tokens == sum(lens) + 8 * 3
    assert m.as_log()["rollout/dynamic_filter/drop_zero_std"] == 5.0
    # one generate call per round with every prompt repeated n times; a fresh seed per round
    assert [rows for rows, _ in gen.calls] == [[r for r in range(0, 5) for _ in range(2)],
                                              [r for r in range(5, 10) for _ in range(2)]]
    assert len({seed for _, seed in gen.calls}) == 2
    # a later rollout id samples with other seeds
    gen2 = FakeGenerator()
    generate_rollout(FakeDataset(20), gen2, scripted_reward, load_filter(FILTER), spec(4, 5), None, 1)
    assert not {s for _, s in gen.calls} & {s for _, s in gen2.calls}


def test_all_zero_rewards_raise_after_a_full_pass():
    ds = FakeDataset(6)
    with pytest.raises(RolloutError, match=r"kept 0/2 groups after a full pass over 8 prompts"):
        generate_rollout(ds, FakeGenerator(), lambda s: 0.0, load_filter(FILTER), spec(2, 4), None, 0)


def test_no_filter_may_cycle_a_small_dataset():
    batch = generate_rollout(FakeDataset(3), FakeGenerator(), scripted_reward, None, spec(5, 2), None, 0)
    assert [g.samples[0].prompt.row for g in batch.groups] == [0, 1, 2, 0, 1]
    assert batch.metrics.num_aborted == 1 and batch.metrics.num_dropped == {}


def test_rank_share_is_a_contiguous_partition():
    for num in (0, 1, 5, 8):
        parts = [rank_share(num, RankInfo(r, 3)) for r in range(3)]
        assert [i for s in parts for i in range(num)[s]] == list(range(num))


def test_eval_mean_reward():
    prompts = FakeDataset(5).prompts
    res = run_eval("toy", prompts, FakeGenerator(), scripted_reward, SamplingParams(seed=1), 3, None)
    # odd rows 1 and 3 score 0+1+2 each; 15 samples
    assert (res.name, res.num_samples, res.score) == ("toy", 15, pytest.approx(6 / 15))
    assert [(s.prompt.row, s.index) for s in res.samples] == [(r, k) for r in range(5) for k in range(3)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(groups):
    return [(g.group_id, [(s.prompt.row, s.index, s.response_text, s.reward) for s in g.samples]) for g in groups]


def _dp_worker(rank: int, world: int, port: int, results) -> None:
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dist = RankInfo(rank, world)
        gen = FakeGenerator()
        batch = generate_rollout(FakeDataset(20), gen, scripted_reward, load_filter(FILTER), spec(4, 5), dist, 0)
        ev = run_eval("toy", FakeDataset(5).prompts, gen, scripted_reward, SamplingParams(seed=1), 3, dist)
        results[rank] = (_summary(batch.groups), batch.metrics.num_dropped, batch.metrics.num_aborted,
                         gen.calls, ev.score, [(s.prompt.row, s.index) for s in ev.samples])
    finally:
        torch_dist.destroy_process_group()


def test_data_parallel_rollout_two_ranks():
    single_gen = FakeGenerator()
    single = generate_rollout(FakeDataset(20), single_gen, scripted_reward, load_filter(FILTER), spec(4, 5), None, 0)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_dp_worker, args=(2, _free_port(), results), nprocs=2, join=True)
        results = dict(results)
    r0, r1 = results[0], results[1]
    assert r0[0] == r1[0] == _summary(single.groups)
    assert r0[1] == r1[1] == {"zero_std": 5} and r0[2] == r1[2] == 1
    # rollout calls (the first two of each rank): the ranks' prompts together are the single run's
    rollout_rows = lambda calls: sorted(r for rows, _ in calls[:2] for r in rows)
    assert len(r0[3]) == len(r1[3]) == 3   # two rollout rounds + one eval call per rank
    assert sorted(rollout_rows(r0[3]) + rollout_rows(r1[3])) == rollout_rows(single_gen.calls)
    assert not set(rollout_rows(r0[3])) & set(rollout_rows(r1[3]))   # no prompt generated twice
    assert {s for _, s in r0[3][:2]}.isdisjoint({s for _, s in r1[3][:2]})   # per-rank seeds
    assert r0[4] == r1[4] == pytest.approx(6 / 15)
    assert r0[5] == r1[5] == [(r, k) for r in range(5) for k in range(3)]
