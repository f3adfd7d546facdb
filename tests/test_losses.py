"""Loss formulas vs direct per-token Python computation; aggregation invariance."""
import dataclasses
import math
import random
import statistics

import pytest
import torch

from furlong.config import Config
from furlong.config_map import loss_config
from furlong.algorithms.advantages import get_estimator, grpo_advantages
from furlong.trainer.batching import pack_micro_batch, padding_micro_batch, token_loss_weights
from furlong.algorithms.losses import (KL_ESTIMATORS, LossMetrics, LossConfig, kl_penalty, policy_loss,
                                  rl_loss, sft_loss, tis_weights)
from furlong.types import TrainSample


def _loss_params(**flags) -> LossConfig:
    """The default flags' LossConfig with `flags` changed."""
    return dataclasses.replace(loss_config(Config()), **flags)


# ------------------------------------------------------------------ advantages

def test_grpo_matches_loops():
    rng = random.Random(0)
    rows = [[rng.choice([0.0, 1.0, 0.5]) for _ in range(5)] for _ in range(7)] + [[1.0] * 5]
    out = grpo_advantages(torch.tensor(rows), True)
    out_raw = grpo_advantages(torch.tensor(rows), False)
    for g, row in enumerate(rows):
        mean = sum(row) / len(row)
        std = statistics.stdev(row)
        for j, r in enumerate(row):
            want = (r - mean) / (std + 1e-6) if std > 0 else r - mean
            assert out[g, j].item() == pytest.approx(want, abs=1e-6)
            assert out_raw[g, j].item() == pytest.approx(r - mean, abs=1e-6)


def test_grpo_single_sample_and_registry():
    assert torch.equal(grpo_advantages(torch.tensor([[3.0], [1.0]]), True), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="--advantage-estimator"):
        get_estimator("gae")
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(4), True)


# ------------------------------------------------------------------ per-token formulas

def _ref_pg(lp, old, a, eps, eps_high, c):
    ratio = math.exp(max(-20.0, min(20.0, lp - old)))
    l1 = -ratio * a
    l2 = -min(max(ratio, 1 - eps), 1 + eps_high) * a
    pg = max(l1, l2)
    if c is not None and a < 0:
        pg = min(pg, -c * a)
    return pg, float(l2 > l1), old - lp


@pytest.mark.parametrize("c", [None, 3.0])
def test_policy_loss_matches_loops(c):
    g = torch.Generator().manual_seed(0)
    n = 200
    lp = torch.randn(n, generator=g, dtype=torch.float64) * 0.5 - 1
    old = lp + torch.randn(n, generator=g, dtype=torch.float64) * 0.6
    old[:5] = lp[:5] - 30  # huge ratios: exercises the +-20 clamp and the dual clip
    a = torch.randn(n, generator=g, dtype=torch.float64)
    pg, cf, kl = policy_loss(lp, old, a, 0.2, 0.28, c)
    for t in range(n):
        want = _ref_pg(lp[t].item(), old[t].item(), a[t].item(), 0.2, 0.28, c)
        assert pg[t].item() == pytest.approx(want[0], rel=1e-9, abs=1e-9)
        assert cf[t].item() == want[1]
        assert kl[t].item() == pytest.approx(want[2])
    assert 0 < cf.mean().item() < 1


def test_kl_estimators_match_formulas():
    lp = torch.tensor([-1.0, -0.2, -3.0, -50.0, -0.01], dtype=torch.float64)
    ref = torch.tensor([-1.5, -0.1, -3.0, -0.5, -40.0], dtype=torch.float64)
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "low_var_kl"}
    for t in range(5):
        d = lp[t].item() - ref[t].item()
        neg = max(-20.0, min(20.0, -d))
        want = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d,
                "low_var_kl": max(-10.0, min(10.0, math.exp(neg) - 1 - neg))}
        for kind, w in want.items():
            assert kl_penalty(lp, ref, kind)[t].item() == pytest.approx(w, rel=1e-9)
    assert kl_penalty(lp, ref, "low_var_kl")[3].item() == 10.0  # clamped
    with pytest.raises(ValueError, match="--kl-loss-type"):
        kl_penalty(lp, ref, "k4")


def test_tis_weights():
    old = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    roll = torch.tensor([-1.0, -2.0, -0.5])
    w = tis_weights(old, roll, 2.0)
    assert not w.requires_grad
    torch.testing.assert_close(w, torch.tensor([1.0, 2.0, math.exp(-0.5)]))


# ------------------------------------------------------------------ rl_loss aggregation

def random_samples(seed, num, with_old=True):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    samples, cur, ent = [], [], []
    for i in range(num):
        p, r = rng.randint(1, 5), rng.randint(1, 7)
        mask = (torch.rand(r, generator=g) > 0.25).float()
        if i == 1:
            mask.zero_()  # a fully masked sample contributes nothing
        lp = -torch.rand(p + r, generator=g, dtype=torch.float64).float() * 2
        samples.append(TrainSample(
            token_ids=torch.randint(0, 50, (p + r,), generator=g), num_prompt_tokens=p,
            advantages=torch.full((r,), float(torch.randn(1, generator=g))),
            rollout_log_probs=-torch.rand(r, generator=g) * 2,
            old_log_probs=(-torch.rand(r, generator=g) * 2) if with_old else None,
            ref_log_probs=-torch.rand(r, generator=g) * 2,
            loss_mask=None if i == 2 else mask))
        cur.append(lp.requires_grad_())       # [P+R] current log-probs at every position
        ent.append(torch.rand(p + r, generator=g).requires_grad_())
    return samples, cur, ent


def textbook(samples, cur, ent, prm, gbs, per_token, constant_len=None):
    """miles' objective, token by token in plain Python (constant_len: Dr.GRPO's token sum / L)."""
    sample_terms, all_tokens = [], []
    for s, lp_s, en_s in zip(samples, cur, ent):
        p, r = s.num_prompt_tokens, s.num_response_tokens
        mask = [1.0] * r if s.loss_mask is None else s.loss_mask.tolist()
        totals = []
        olds = [lp_s[p - 1 + j].item() if s.old_log_probs is None else s.old_log_probs[j].item() for j in range(r)]
        diffs = [lp_s[p - 1 + j].item() - olds[j] for j in range(r)]
        # GSPO: every token's log-ratio is the sample's mean over its trained tokens
        seq_lr = sum(m * d for m, d in zip(mask, diffs)) / sum(mask) if sum(mask) else 0.0
        for j in range(r):
            lp = lp_s[p - 1 + j].item()
            old = olds[j]
            lp_for_ratio = old + seq_lr if prm.sequence_ratio else lp
            pg = _ref_pg(lp_for_ratio, old, s.advantages[j].item(), prm.eps_clip, prm.eps_clip_high,
                         prm.eps_clip_c)[0]
            if prm.use_tis:
                pg *= min(max(math.exp(old - s.rollout_log_probs[j].item()), prm.tis_clip_low), prm.tis_clip)
            tot = pg
            if prm.use_kl_loss:
                d = lp - s.ref_log_probs[j].item()
                kl = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[prm.kl_loss_type]
                tot += prm.kl_loss_coef * kl * (math.exp(lp - old) if prm.use_unbiased_kl else 1.0)
            tot -= prm.entropy_coef * en_s[p - 1 + j].item()
            totals.append(tot)
        num = sum(mask) if constant_len is None else constant_len
        sample_terms.append(sum(m * t for m, t in zip(mask, totals)) / num if num else 0.0)
        all_tokens += [(m, t) for m, t in zip(mask, totals)]
    if per_token:
        return sum(m * t for m, t in all_tokens) / sum(m for m, _ in all_tokens)
    return sum(sample_terms) / gbs


PARAMS = [
    _loss_params(eps_clip=0.2, eps_clip_high=0.28),
    _loss_params(eps_clip=0.1, eps_clip_high=0.3, eps_clip_c=3.0, use_kl_loss=True, kl_loss_coef=0.3,
               kl_loss_type="k3", entropy_coef=0.01, use_tis=True, tis_clip=1.5),
    _loss_params(eps_clip=0.2, eps_clip_high=0.2, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k2"),
    _loss_params(eps_clip=3e-4, eps_clip_high=4e-4, sequence_ratio=True),                       # GSPO
    _loss_params(eps_clip=0.2, eps_clip_high=0.28, sequence_ratio=True, use_tis=True, tis_clip=2.0, tis_clip_low=0.5,
               use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k1", use_unbiased_kl=True),
]


def run_partition(samples, cur, ent, weights, parts, prm):
    total, metrics = 0.0, LossMetrics.zeros()
    for idx in parts:
        if idx:
            mb = pack_micro_batch(samples, weights, idx)
            lp, en = torch.cat([cur[i] for i in idx]), torch.cat([ent[i] for i in idx])
        else:   # what a rank short of micro-batches runs: one zero-weight token
            mb = padding_micro_batch(samples[0].old_log_probs is not None, samples[0].ref_log_probs is not None)
            lp, en = torch.zeros(1), torch.zeros(1)
        loss, m = rl_loss(mb, lp, en, prm)
        total = total + loss
        metrics = metrics + m
    for t in cur + ent:
        t.grad = None
    total.backward()
    return total.item(), metrics, [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in cur + ent]


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("pi", range(len(PARAMS)))
@pytest.mark.parametrize("with_old", [True, False])
def test_aggregation_invariance_and_textbook(per_token, pi, with_old):
    prm = PARAMS[pi]
    samples, cur, ent = random_samples(pi + 10 * per_token, 9, with_old)
    gbs = len(samples)
    count = sum(int((s.loss_mask if s.loss_mask is not None else torch.ones(s.num_response_tokens)).sum())
                for s in samples)
    weights = token_loss_weights(samples, gbs, per_token, count)
    one = [list(range(gbs))]
    rng = random.Random(pi)
    order = list(range(gbs))
    rng.shuffle(order)
    split = [order[:2], [], order[2:3], order[3:7], order[7:]]  # includes a padding micro-batch
    big_loss, big_m, big_g = run_partition(samples, cur, ent, weights, one, prm)
    part_loss, part_m, part_g = run_partition(samples, cur, ent, weights, split, prm)
    assert part_loss == pytest.approx(big_loss, rel=1e-5, abs=1e-6)
    for a, b in zip(big_g, part_g):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(big_m.stacked(), part_m.stacked(), atol=1e-6, rtol=1e-5)
    assert big_loss == pytest.approx(textbook(samples, cur, ent, prm, gbs, per_token), rel=1e-5, abs=1e-6)
    assert big_m.loss.item() == pytest.approx(big_loss, rel=1e-6)


def test_metrics_are_weighted_means():
    samples, cur, ent = random_samples(3, 4)
    weights = token_loss_weights(samples, 4, False, 0)
    mb = pack_micro_batch(samples, weights, [0, 1, 2, 3])
    lp = torch.cat(cur)
    _, m = rl_loss(mb, lp, torch.cat(ent), _loss_params())
    # ppo_kl: per-sample token mean of old - logp, averaged over the 4 samples.
    want = 0.0
    for s, c in zip(samples, cur):
        p, r = s.num_prompt_tokens, s.num_response_tokens
        mask = torch.ones(r) if s.loss_mask is None else s.loss_mask
        if mask.sum() > 0:
            want += ((s.old_log_probs - c.detach()[p - 1:p - 1 + r]) * mask).sum().item() / mask.sum().item()
    assert m.ppo_kl.item() == pytest.approx(want / 4, rel=1e-5)
    assert m.kl_loss.item() == 0.0
    names = [f.name for f in dataclasses.fields(LossMetrics)]
    assert names[0] == "loss" and m.stacked().shape == (len(names),)
    assert LossMetrics.from_host(m.stacked().tolist()).ppo_kl.item() == pytest.approx(m.ppo_kl.item())


def test_reuse_gradient_is_advantage():
    samples, cur, _ = random_samples(5, 3, with_old=False)
    weights = token_loss_weights(samples, 3, False, 0)
    mb = pack_micro_batch(samples, weights, [0, 1, 2])
    lp = torch.cat(cur).detach().requires_grad_()
    loss, m = rl_loss(mb, lp, None, _loss_params())
    loss.backward()
    # ratio == 1 everywhere: d loss / d logp = -A * weight, and ppo_kl is exactly 0.
    torch.testing.assert_close(lp.grad, -mb.advantages * mb.loss_weight)
    assert loss.item() == pytest.approx(-(mb.advantages * mb.loss_weight).sum().item(), rel=1e-6)
    assert m.ppo_kl.item() == 0.0 and m.pg_clipfrac.item() == 0.0


def test_sft_loss():
    samples, cur, _ = random_samples(7, 3)
    weights = token_loss_weights(samples, 3, False, 0)
    mb = pack_micro_batch(samples, weights, [2, 0])
    lp = torch.cat([cur[2], cur[0]])
    want = 0.0
    for i in (2, 0):
        s = samples[i]
        p, r = s.num_prompt_tokens, s.num_response_tokens
        mask = torch.ones(r) if s.loss_mask is None else s.loss_mask
        if mask.sum() > 0:
            want -= (cur[i].detach()[p - 1:p - 1 + r] * mask).sum().item() / mask.sum().item() / 3
    assert sft_loss(mb, lp).item() == pytest.approx(want, rel=1e-5)


def test_bad_inputs_and_config():
    samples, cur, _ = random_samples(8, 2)
    for s in samples:
        s.ref_log_probs = None
    weights = token_loss_weights(samples, 2, False, 0)
    mb = pack_micro_batch(samples, weights, [0, 1])
    with pytest.raises(ValueError, match="--entropy-coef"):
        rl_loss(mb, torch.cat(cur), None, _loss_params(entropy_coef=0.1))
    with pytest.raises(ValueError, match="--use-kl-loss"):
        rl_loss(mb, torch.cat(cur), None, _loss_params(use_kl_loss=True))
    cfg = Config()
    cfg.algo.eps_clip, cfg.algo.eps_clip_high, cfg.algo.use_tis = 0.1, 0.3, True
    prm = loss_config(cfg)
    assert (prm.eps_clip, prm.eps_clip_high, prm.use_tis, prm.tis_clip) == (0.1, 0.3, True, 2.0)


def test_non_finite_values_on_masked_tokens_do_not_reach_the_loss():
    """A NaN/inf log-ratio or KL on a token without loss weight is zeroed before the sum."""
    samples, cur, ent = random_samples(5, 4)
    samples[0].loss_mask = torch.ones(samples[0].num_response_tokens)
    samples[0].loss_mask[0] = 0.0
    samples[0].old_log_probs[0] = float("nan")
    samples[0].ref_log_probs[0] = float("inf")
    weights = token_loss_weights(samples, 4, False, 0)
    mb = pack_micro_batch(samples, weights, [0, 1, 2, 3])
    for prm in (PARAMS[1], PARAMS[4]):
        loss, m = rl_loss(mb, torch.cat(cur), torch.cat(ent), prm)
        assert torch.isfinite(loss) and torch.isfinite(m.stacked()).all()
        loss.backward()
        assert all(torch.isfinite(t.grad).all() for t in cur if t.grad is not None)


@pytest.mark.parametrize("pi", [0, 3])
def test_dr_grpo_constant_normalizer(pi):
    """seq-mean-token-sum-norm: each sample's token sum over a constant length, over the batch size."""
    prm = PARAMS[pi]
    samples, cur, ent = random_samples(40 + pi, 7)
    weights = token_loss_weights(samples, 7, False, 0, constant_len=11)
    loss, _, _ = run_partition(samples, cur, ent, weights, [[0, 1, 2], [3, 4, 5, 6]], prm)
    assert loss == pytest.approx(textbook(samples, cur, ent, prm, 7, False, constant_len=11), rel=1e-5, abs=1e-7)
