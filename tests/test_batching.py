"""Micro-batch planning, rank split, loss weights and packing."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from furlong.trainer.batching import (move_micro_batch, num_loss_tokens, pack_micro_batch,
                                    token_loss_weights)
from furlong.trainer.planning import balance_stats, fixed_micro_batches, plan_micro_batches, split_across_ranks
from furlong.types import TrainSample


def ffd_reference(lengths, cap):
    """Plain first-fit decreasing over the samples that fit; oversize ones alone."""
    loads = []
    for n in sorted((n for n in lengths if n <= cap), reverse=True):
        for b, load in enumerate(loads):
            if load + n <= cap:
                loads[b] += n
                break
        else:
            loads.append(n)
    return loads, sum(1 for n in lengths if n > cap)


def assert_no_pair_improvement(lengths, bins, cap):
    """Some heaviest bin cannot hand a move or swap to a lighter bin that narrows their gap
    within cap (so single moves cannot lower the largest load)."""
    loads = [sum(lengths[i] for i in b) for b in bins]
    top = max(loads, default=0)

    def improvable(hi):
        for lo in range(len(bins)):
            gap = top - loads[lo]
            for i in bins[hi]:
                for d in [lengths[i]] + [lengths[i] - lengths[j] for j in bins[lo]]:
                    if 0 < d < gap and loads[lo] + d <= cap:
                        return True
        return False
    assert not bins or not all(improvable(b) for b in range(len(bins)) if loads[b] == top), bins


lengths_st = st.lists(st.integers(min_value=0, max_value=150), max_size=60)


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, cap=st.integers(min_value=1, max_value=600))
def test_plan_properties(lengths, cap):
    plan = plan_micro_batches(lengths, cap)
    flat = sorted(i for mb in plan for i in mb)
    assert flat == list(range(len(lengths)))                     # every index exactly once
    assert all(mb for mb in plan)
    for mb in plan:
        total = sum(lengths[i] for i in mb)
        assert total <= cap or len(mb) == 1                       # cap, or one oversize sample alone
        assert mb == sorted(mb)
    loads, oversize = ffd_reference(lengths, cap)
    assert len(plan) == len(loads) + oversize                     # fewest: FFD's count
    fitting = [sum(lengths[i] for i in mb) for mb in plan if sum(lengths[i] for i in mb) <= cap]
    assert max(fitting, default=0) <= max(loads, default=0)       # never less balanced than FFD
    assert plan_micro_batches(list(lengths), cap) == plan         # deterministic
    assert_no_pair_improvement(lengths, [mb for mb in plan if sum(lengths[i] for i in mb) <= cap], cap)
    stats = balance_stats(lengths, plan)
    sums = [sum(lengths[i] for i in mb) for mb in plan]
    assert stats.num_micro_batches == len(plan)
    if plan:
        assert stats.max_tokens == max(sums)
        assert stats.mean_tokens == pytest.approx(sum(sums) / len(sums))
        if sum(sums):
            assert stats.imbalance == pytest.approx(max(sums) * len(sums) / sum(sums))


def test_plan_balances_where_ffd_does_not():
    lengths = [5, 5, 5, 5, 5, 1]
    plan = plan_micro_batches(lengths, 20)
    sums = sorted(sum(lengths[i] for i in mb) for mb in plan)
    assert sums == [11, 15]          # FFD would give [6, 20]
    assert balance_stats(lengths, plan).imbalance == pytest.approx(15 / 13)


def test_plan_evens_out_kk():
    lengths = [88, 43, 61, 72, 13, 46, 56, 41, 79, 82, 27, 71, 62, 57, 67, 34, 8, 71, 2, 12, 93, 52, 91,
               86, 81, 1, 79, 64, 43]
    sums = sorted(sum(lengths[i] for i in mb) for mb in plan_micro_batches(lengths, 224))
    assert len(sums) == 8 and sums[-1] <= 199   # KK + repair alone leaves 194..205


def test_plan_oversize_and_edges():
    assert plan_micro_batches([], 10) == []
    assert plan_micro_batches([50, 3, 4], 10) == [[0], [1, 2]]
    assert balance_stats([], []).imbalance == 1.0
    with pytest.raises(ValueError, match="--max-tokens-per-gpu"):
        plan_micro_batches([1], 0)
    with pytest.raises(ValueError):
        plan_micro_batches([1, -2], 5)


def test_plan_realistic_is_tight():
    g = torch.Generator().manual_seed(0)
    lengths = (torch.randint(100, 1200, (256,), generator=g)).tolist()
    plan = plan_micro_batches(lengths, 8192)
    stats = balance_stats(lengths, plan)
    assert stats.num_micro_batches == -(-sum(lengths) // 8192)   # hits the lower bound here
    assert stats.max_tokens <= 8192 and stats.imbalance < 1.05


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, world=st.integers(min_value=1, max_value=9))
def test_split_across_ranks(lengths, world):
    ranks = split_across_ranks(lengths, world)
    assert len(ranks) == world
    assert sorted(i for r in ranks for i in r) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in r) for r in ranks]
    assert_no_pair_improvement(lengths, ranks, float("inf"))
    if lengths:
        # Greedy-list-scheduling bound; KK is at least this good in practice.
        assert max(loads) <= sum(lengths) / world + max(lengths)
    assert split_across_ranks(list(lengths), world) == ranks


def test_split_examples():
    ranks = split_across_ranks([3, 3, 2, 2, 2], 2)   # plain KK gives 7 / 5
    assert sorted(sum([3, 3, 2, 2, 2][i] for i in r) for r in ranks) == [6, 6]
    assert sorted(map(len, split_across_ranks([7], 3))) == [0, 0, 1]
    with pytest.raises(ValueError):
        split_across_ranks([1], 0)


def test_fixed_micro_batches():
    assert fixed_micro_batches([4, 1, 3, 0, 2], 2) == [[4, 1], [3, 0], [2]]
    assert fixed_micro_batches([], 3) == []
    with pytest.raises(ValueError, match="--micro-batch-size"):
        fixed_micro_batches([1], 0)


def sample(prompt, response, mask=None, old=True, adv=1.0):
    r = len(response)
    return TrainSample(token_ids=torch.tensor(prompt + response), num_prompt_tokens=len(prompt),
                       advantages=torch.full((r,), adv), rollout_log_probs=-torch.arange(1, r + 1).float(),
                       old_log_probs=-torch.arange(1, r + 1).float() / 10 if old else None,
                       loss_mask=None if mask is None else torch.tensor(mask, dtype=torch.float32))


def test_token_loss_weights():
    ss = [sample([1, 2], [3, 4, 5]), sample([1], [6, 7], mask=[1, 0]), sample([1], [8], mask=[0])]
    w = token_loss_weights(ss, 4, False, 0)
    torch.testing.assert_close(w[0], torch.full((3,), 1 / 12))
    torch.testing.assert_close(w[1], torch.tensor([1 / 4, 0.0]))
    torch.testing.assert_close(w[2], torch.tensor([0.0]))
    assert num_loss_tokens(ss) == 4
    w = token_loss_weights(ss, 4, True, 8)  # 8: other ranks hold 4 more tokens
    torch.testing.assert_close(w[0], torch.full((3,), 1 / 8))
    torch.testing.assert_close(w[1], torch.tensor([1 / 8, 0.0]))
    with pytest.raises(ValueError, match="--global-batch-size"):
        token_loss_weights(ss, 0, False, 0)


def test_pack_micro_batch_layout():
    ss = [sample([10, 11], [12, 13, 14], adv=2.0), sample([20], [21, 22], mask=[0, 1], adv=-1.0),
          sample([30, 31, 32], [33], adv=0.5)]
    w = token_loss_weights(ss, 3, False, 0)
    mb = pack_micro_batch(ss, w, [2, 0])
    assert mb.input_ids.tolist() == [30, 31, 32, 33, 10, 11, 12, 13, 14]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert mb.cu_seqlens.tolist() == [0, 4, 9] and mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == 5 and mb.sample_indices == [2, 0]
    assert mb.targets.tolist() == [31, 32, 33, 0, 11, 12, 13, 14, 0]
    # response token j of a sample with P prompt tokens sits at P-1+j: targets there are the response.
    assert mb.response_mask.tolist() == [0, 0, 1, 0, 0, 1, 1, 1, 0]
    assert mb.targets[mb.response_mask.bool()].tolist() == [33, 12, 13, 14]
    torch.testing.assert_close(mb.loss_weight, torch.tensor([0, 0, 1 / 3, 0, 0, 1 / 9, 1 / 9, 1 / 9, 0]))
    assert mb.advantages.tolist() == [0, 0, 0.5, 0, 0, 2, 2, 2, 0]
    torch.testing.assert_close(mb.old_log_probs, torch.tensor([0, 0, -0.1, 0, 0, -0.1, -0.2, -0.3, 0]))
    torch.testing.assert_close(mb.rollout_log_probs, torch.tensor([0, 0, -1.0, 0, 0, -1, -2, -3, 0]))
    assert mb.ref_log_probs is None
    mb1 = pack_micro_batch(ss, w, [1])
    assert mb1.response_mask.tolist() == [0, 1, 0]
    torch.testing.assert_close(mb1.loss_weight, torch.tensor([0, 1 / 3, 0]))
    moved = move_micro_batch(mb, "cpu")
    assert torch.equal(moved.targets, mb.targets) and moved.ref_log_probs is None


def test_pack_errors_and_empty():
    ss = [sample([1], [2]), sample([1], [3], old=False)]
    w = token_loss_weights(ss, 2, False, 0)
    with pytest.raises(ValueError, match="old/ref"):
        pack_micro_batch(ss, w, [0, 1])
    bad = [sample([], [2, 3])]
    with pytest.raises(ValueError, match="prompt token"):
        pack_micro_batch(bad, token_loss_weights(bad, 1, False, 0), [0])
    with pytest.raises(ValueError, match="no samples"):   # a rank short of micro-batches pads with padding_micro_batch
        pack_micro_batch(ss[:1], w[:1], [])
