"""Rollout: filter registry, over-sampling with the dynamic filter, eval, data-parallel rollout (gloo)."""
from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp

from furlong.rollout.eval import run_eval
from furlong.rollout.filters import check_reward_nonzero_std, load_filter
from furlong.engine import Completion, EngineStats, Request
from furlong.rollout.rollout import RolloutError, RolloutConfig, generate_rollout, rank_share
from furlong.engine.sampling import SamplingParams
from furlong.types import DistContext, Group, Prompt, Sample


def _ranks(rank: int, world: int) -> DistContext:
    return DistContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")


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


class FakeEngine:
    """Scripted engine with the real one's interface: every `step` adds one token to every
    running sample; the k-th sample of a prompt row answers "row:k" with 1 + (row + k) % max_len
    tokens, so groups finish at different steps, as with real continuous batching."""

    def __init__(self, max_len: int = 4):
        self.max_len = max_len
        self.requests: list[tuple[int, int]] = []     # (prompt row, seed) per request added
        self.running: dict[int, list[list]] = {}      # request id -> [[sample index, row, tokens so far]]
        self.next_id = 0
        self.aborted: list[int] = []

    def new_request_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def add(self, req: Request) -> None:
        self.requests.append((req.prompt_ids[0], req.seed))
        self.running[req.request_id] = [[k, req.prompt_ids[0], 0] for k in range(req.n)]

    def has_work(self) -> bool:
        return bool(self.running)

    def _length(self, row: int, k: int) -> int:
        return 1 + (row + k) % self.max_len

    def _completion(self, rid: int, k: int, row: int, num: int, reason: str) -> Completion:
        return Completion(rid, k, [row] * num, [-0.5] * num, f"{row}:{k}", reason)

    def step(self) -> list[Completion]:
        done = []
        for rid in list(self.running):
            left = []
            for k, row, num in self.running[rid]:
                num += 1
                if num == self._length(row, k):
                    done.append(self._completion(rid, k, row, num, "length" if num == self.max_len else "stop"))
                else:
                    left.append([k, row, num])
            if left:
                self.running[rid] = left
            else:
                del self.running[rid]
        return done

    def abort(self, ids: set[int]) -> list[Completion]:
        out = [self._completion(rid, k, row, num, "abort") for rid in ids if rid in self.running
               for k, row, num in self.running.pop(rid)]
        self.aborted.extend(ids)
        return out

    def generate(self, reqs: list[Request]) -> list[list[Completion]]:
        for r in reqs:
            self.add(r)
        got: dict[int, list[Completion]] = {r.request_id: [] for r in reqs}
        while self.has_work():
            for c in self.step():
                got[c.request_id].append(c)
        return [sorted(got[r.request_id], key=lambda c: c.index) for r in reqs]

    def reset_stats(self) -> EngineStats:
        return EngineStats()

    def release(self) -> None:
        pass


def scripted_reward(sample: Sample) -> float:
    """Even rows: every sample gets 0 (zero std, dropped). Odd rows: the sample index."""
    row, k = map(int, sample.response_text.split(":"))
    return 0.0 if row % 2 == 0 else float(k)


def spec(batch: int, over: int, n: int = 2, seed: int = 3) -> RolloutConfig:
    return RolloutConfig(rollout_batch_size=batch, n_samples_per_prompt=n, over_sampling_batch_size=over,
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
    for bad, why in (("no_such_pkg_xyz.mod.fn", "cannot import"), ("os.path.no_such_fn", "has no function"),
                     ("nodots", "dotted path")):
        with pytest.raises(ValueError, match=f"--dynamic-sampling-filter-path: .*{why}"):
            load_filter(bad)
    assert check_reward_nonzero_std(_group([0.0, 1.0])) is True
    assert check_reward_nonzero_std(_group([1.0, 1.0, 1.0])) is False
    assert check_reward_nonzero_std(_group([0.5])) is False


def test_streaming_over_sampling_keeps_exact_count_and_counts_drops():
    # Batches of 5 prompts, n=2, target 4. Group r finishes at step max_k(1 + (r+k) % 4) after it
    # is submitted; even rows have zero reward std (dropped), odd rows pass.
    # step 2: rows 0, 4 dropped; kept 0 + in flight 3 < 4, so rows 5-9 are submitted
    # step 3: row 1 kept; step 4: row 2 dropped, 3 kept, 8 (started step 3, length 2) dropped;
    # step 5: rows 5, 9 kept -> 4 kept; rows 6, 7 still running are aborted.
    eng = FakeEngine()
    batch = generate_rollout(FakeDataset(20), eng, scripted_reward, load_filter(FILTER), spec(4, 5), None, 0)
    assert [g.samples[0].prompt.row for g in batch.groups] == [1, 3, 5, 9]
    assert [g.group_id for g in batch.groups] == [1, 3, 5, 9]
    assert all([s.index for s in g.samples] == [0, 1] for g in batch.groups)
    m = batch.metrics
    assert (m.num_dropped, m.num_aborted, m.num_generated_groups) == ({"zero_std": 4}, 2, 8)
    assert [row for row, _ in eng.requests] == list(range(10)) and len(eng.aborted) == 2
    assert m.raw_reward == 0.5
    lens = [len(s.response_ids) for g in batch.groups for s in g.samples]
    assert m.response_len_mean == sum(lens) / 8 and m.response_len_max == max(lens)
    assert m.truncated_ratio == sum(n == 4 for n in lens) / 8
    assert m.rollout_log_probs == -0.5
    assert m.as_log()["rollout/dynamic_filter/drop_zero_std"] == 4.0
    assert len({seed for _, seed in eng.requests}) == 10            # one seed per group
    eng2 = FakeEngine()                                              # a later rollout samples with other seeds
    generate_rollout(FakeDataset(20), eng2, scripted_reward, load_filter(FILTER), spec(4, 5), None, 1)
    assert not {s for _, s in eng.requests} & {s for _, s in eng2.requests}


def test_all_zero_rewards_raise_after_a_full_pass():
    ds = FakeDataset(6)
    with pytest.raises(RolloutError, match=r"kept 0/2 groups after a full pass over 8 prompts"):
        generate_rollout(ds, FakeEngine(), lambda s: 0.0, load_filter(FILTER), spec(2, 4), None, 0)


def test_no_filter_may_cycle_a_small_dataset():
    # no filter: the small data set cycles; groups are kept in the order they finish
    batch = generate_rollout(FakeDataset(3), FakeEngine(), scripted_reward, None, spec(5, 2), None, 0)
    assert sorted(g.samples[0].prompt.row for g in batch.groups) == [0, 0, 1, 1, 2]
    assert len(batch.groups) == 5 and batch.metrics.num_dropped == {}


def test_rank_share_is_a_contiguous_partition():
    for num in (0, 1, 5, 8):
        parts = [rank_share(num, _ranks(r, 3)) for r in range(3)]
        assert [i for s in parts for i in range(num)[s]] == list(range(num))


def test_eval_mean_reward():
    prompts = FakeDataset(5).prompts
    res = run_eval("toy", prompts, FakeEngine(), scripted_reward, SamplingParams(seed=1), 3, None)
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
        ranks = _ranks(rank, world)
        eng = FakeEngine()
        batch = generate_rollout(FakeDataset(20), eng, scripted_reward, load_filter(FILTER), spec(4, 5), ranks, 0)
        rollout_requests = list(eng.requests)
        ev = run_eval("toy", FakeDataset(5).prompts, eng, scripted_reward, SamplingParams(seed=1), 3, ranks)
        results[rank] = (_summary(batch.groups), batch.metrics.num_dropped, batch.metrics.num_aborted,
                         rollout_requests, ev.score, [(s.prompt.row, s.index) for s in ev.samples])
    finally:
        torch_dist.destroy_process_group()


def test_data_parallel_rollout_two_ranks():
    single_eng = FakeEngine()
    single = generate_rollout(FakeDataset(20), single_eng, scripted_reward, load_filter(FILTER), spec(4, 5), None, 0)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_dp_worker, args=(2, _free_port(), results), nprocs=2, join=True)
        results = dict(results)
    r0, r1 = results[0], results[1]
    assert r0[0] == r1[0] == _summary(single.groups)
    assert r0[1] == r1[1] == {"zero_std": 4} and r0[2] == r1[2] == 2
    # the ranks' requests together are the single run's (same prompts, same seeds), none twice
    assert sorted(r0[3] + r1[3]) == sorted(single_eng.requests)
    assert not {row for row, _ in r0[3]} & {row for row, _ in r1[3]}
    assert r0[4] == r1[4] == pytest.approx(6 / 15)
    assert r0[5] == r1[5] == [(r, k) for r in range(5) for k in range(3)]
