"""Advantage estimators and whitening against direct loop-by-loop references (miles semantics)."""
from __future__ import annotations

import math
import random
import socket
import statistics

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp

from furlong.algorithms.advantages import ESTIMATORS, AdvantageInputs, AdvantageConfig, get_estimator, whiten


# ------------------------------------------------------------------ random inputs

def _batch(seed: int, groups: int, n: int, with_kl: bool = True, with_values: bool = False):
    """Ragged responses (lengths 0..9), masks with zeros (some fully masked, some with a
    masked tail), rewards from a few values so groups tie, group 0 constant (zero std)."""
    rng = random.Random(seed)
    rewards = [[rng.choice([0.0, 0.5, 1.0, -1.0]) for _ in range(n)] for _ in range(groups)]
    rewards[0] = [0.75] * n
    lengths = [rng.choice([0, 1, 2, 5, 9]) for _ in range(groups * n)]
    masks = []
    for i, r in enumerate(lengths):
        kind = i % 4
        if kind == 0:
            m = [1.0] * r
        elif kind == 1:   # masked tail: the last trained token is not the last token
            m = [1.0] * (r - r // 2) + [0.0] * (r // 2)
        elif kind == 2:
            m = [float(rng.random() < 0.6) for _ in range(r)]
        else:
            m = [0.0] * r
        masks.append(m)
    kl = [[rng.uniform(-0.5, 1.0) for _ in range(r)] for r in lengths] if with_kl else None
    values = [[rng.uniform(-1.0, 1.0) for _ in range(r)] for r in lengths] if with_values else None
    t = lambda rows: [torch.tensor(x, dtype=torch.float32) for x in rows]   # noqa: E731
    inputs = AdvantageInputs(rewards=torch.tensor(rewards, dtype=torch.float32), response_masks=t(masks),
                             kl=t(kl) if kl is not None else None, values=t(values) if values is not None else None)
    return inputs, rewards, masks, kl, values


def _close(got: list[torch.Tensor], want: list[list[float]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == (len(w),)
        assert g.tolist() == pytest.approx(w, rel=1e-5, abs=1e-5)


def _flat(rows: list[list[float]]) -> list[float]:
    return [r for row in rows for r in row]


# ------------------------------------------------------------------ references

def _ref_grpo(rewards, normalize_std):
    out = []
    for row in rewards:
        mean = sum(row) / len(row)
        std = statistics.stdev(row) if len(row) > 1 else 0.0
        out += [(r - mean) / (std + 1e-6) if normalize_std and std > 0 else r - mean for r in row]
    return out


def _ref_rloo(rewards):
    out = []
    for row in rewards:
        for j, r in enumerate(row):
            others = [x for k, x in enumerate(row) if k != j]
            out.append(r - sum(others) / len(others) if others else 0.0)
    return out


def _kl_at(kl, i, t, c):
    return 0.0 if kl is None else -c * kl[i][t]


def _ref_rpp(rewards, masks, kl, c, gamma):
    out = []
    for i, (r, m) in enumerate(zip(_flat(rewards), masks)):
        x = [_kl_at(kl, i, t, c) for t in range(len(m))]
        trained = [t for t in range(len(m)) if m[t] > 0]
        if trained:
            x[trained[-1]] += r
        g, ret = 0.0, [0.0] * len(m)
        for t in reversed(range(len(m))):
            g = x[t] + gamma * g
            ret[t] = g
        out.append(ret)
    return out


def _ref_rpp_baseline(rewards, masks, kl, c):
    centered = []
    for row in rewards:
        centered += [r - sum(row) / len(row) for r in row]
    return [[centered[i] + _kl_at(kl, i, t, c) for t in range(len(m))] for i, m in enumerate(masks)]


def _ref_ppo(rewards, masks, kl, values, c, gamma, lambd):
    advs, rets = [], []
    for i, (r, m) in enumerate(zip(_flat(rewards), masks)):
        adv, ret = [0.0] * len(m), [0.0] * len(m)
        trained = [t for t in range(len(m)) if m[t] > 0]
        last, next_v = 0.0, 0.0
        for k in reversed(range(len(trained))):
            t = trained[k]
            x = _kl_at(kl, i, t, c) + (r if k == len(trained) - 1 else 0.0)
            delta = x + gamma * next_v - values[i][t]
            last = delta + gamma * lambd * last
            adv[t], ret[t] = last, last + values[i][t]
            next_v = values[i][t]
        advs.append(adv)
        rets.append(ret)
    return advs, rets


def _ref_whiten(advs, masks):
    pairs = [(a, m) for av, mv in zip(advs, masks) for a, m in zip(av, mv)]
    count = sum(m for _, m in pairs)
    mean = sum(a * m for a, m in pairs) / count
    var = sum(m * (a - mean) ** 2 for a, m in pairs) / (count - 1 if count >= 2 else count)
    return [[(a - mean) / math.sqrt(var + 1e-8) for a in av] for av in advs]


# ------------------------------------------------------------------ estimators

SHAPES = [(0, 5, 4), (1, 6, 1), (2, 3, 2), (3, 4, 7)]   # (seed, groups, n)


@pytest.mark.parametrize("seed,groups,n", SHAPES)
@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_and_gspo(seed, groups, n, normalize_std):
    inputs, rewards, masks, _, _ = _batch(seed, groups, n)
    want = [[a] * len(m) for a, m in zip(_ref_grpo(rewards, normalize_std), masks)]
    for name in ("grpo", "gspo"):
        adv, ret = get_estimator(name)(inputs, AdvantageConfig(normalize_std=normalize_std, kl_coef=0.3))
        _close(adv, want)
        _close(ret, want)


@pytest.mark.parametrize("seed,groups,n", SHAPES)
def test_rloo(seed, groups, n):
    inputs, rewards, masks, _, _ = _batch(seed, groups, n)
    adv, ret = get_estimator("rloo")(inputs, AdvantageConfig())
    want = [[a] * len(m) for a, m in zip(_ref_rloo(rewards), masks)]
    _close(adv, want)
    _close(ret, want)


@pytest.mark.parametrize("seed,groups,n", SHAPES)
@pytest.mark.parametrize("kl_coef,gamma", [(0.0, 1.0), (0.1, 1.0), (0.5, 0.9), (1.0, 0.0), (0.2, 0.5)])
@pytest.mark.parametrize("with_kl", [True, False])
def test_reinforce_plus_plus(seed, groups, n, kl_coef, gamma, with_kl):
    inputs, rewards, masks, kl, _ = _batch(seed, groups, n, with_kl=with_kl)
    adv, ret = get_estimator("reinforce_plus_plus")(inputs, AdvantageConfig(kl_coef=kl_coef, gamma=gamma))
    want = _ref_rpp(rewards, masks, kl, kl_coef, gamma)
    _close(adv, want)
    _close(ret, want)


@pytest.mark.parametrize("seed,groups,n", SHAPES)
@pytest.mark.parametrize("kl_coef,gamma", [(0.0, 1.0), (0.3, 0.9), (1.0, 0.0)])
def test_reinforce_plus_plus_baseline(seed, groups, n, kl_coef, gamma):
    inputs, rewards, masks, kl, _ = _batch(seed, groups, n)
    adv, ret = get_estimator("reinforce_plus_plus_baseline")(inputs, AdvantageConfig(kl_coef=kl_coef, gamma=gamma))
    want = _ref_rpp_baseline(rewards, masks, kl, kl_coef)
    _close(adv, want)
    _close(ret, want)


@pytest.mark.parametrize("seed,groups,n", SHAPES)
@pytest.mark.parametrize("kl_coef,gamma,lambd", [(0.0, 1.0, 1.0), (0.1, 0.99, 0.95), (0.5, 0.9, 0.0),
                                                 (1.0, 0.0, 0.7), (0.2, 1.0, 0.5)])
def test_ppo_gae(seed, groups, n, kl_coef, gamma, lambd):
    inputs, rewards, masks, kl, values = _batch(seed, groups, n, with_values=True)
    adv, ret = get_estimator("ppo")(inputs, AdvantageConfig(kl_coef=kl_coef, gamma=gamma, lambd=lambd))
    want_adv, want_ret = _ref_ppo(rewards, masks, kl, values, kl_coef, gamma, lambd)
    _close(adv, want_adv)
    _close(ret, want_ret)


def test_long_response_discounting():
    """A response longer than any loop shortcut: 300 tokens, gamma < 1, reward at the last trained token."""
    inputs, rewards, masks, kl, _ = _batch(7, 2, 3)
    inputs.response_masks[1] = torch.ones(300)
    inputs.response_masks[1][-10:] = 0
    inputs.kl[1] = torch.linspace(-1, 1, 300)
    masks[1], kl[1] = inputs.response_masks[1].tolist(), inputs.kl[1].tolist()
    adv, _ = get_estimator("reinforce_plus_plus")(inputs, AdvantageConfig(kl_coef=0.05, gamma=0.97))
    _close(adv, _ref_rpp(rewards, masks, kl, 0.05, 0.97))


def test_registry_and_errors():
    assert set(ESTIMATORS) == {"grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"}
    for name in ESTIMATORS:
        assert get_estimator(name) is ESTIMATORS[name]
    with pytest.raises(ValueError, match="--advantage-estimator.*'gae'.*reinforce_plus_plus"):
        get_estimator("gae")



def test_disable_rewards_normalization_gives_raw_rewards():
    """--disable-rewards-normalization: grpo/gspo put the raw reward on every token; the
    reinforce++ baseline skips its group mean but keeps the per-token KL penalty."""
    rewards = torch.tensor([[1.0, 0.0, 3.0], [2.0, 2.0, 5.0]])
    masks = [torch.ones(k) for k in (2, 3, 1, 4, 2, 3)]
    kl = [torch.full((m.numel(),), 0.5) for m in masks]
    raw = AdvantageConfig(normalize_rewards=False, kl_coef=0.2)
    adv, _ = get_estimator("grpo")(AdvantageInputs(rewards, masks, None), raw)
    for a, r, m in zip(adv, rewards.flatten(), masks):
        torch.testing.assert_close(a, torch.full((m.numel(),), float(r)))
    adv, _ = get_estimator("reinforce_plus_plus_baseline")(AdvantageInputs(rewards, masks, kl), raw)
    for a, r, m in zip(adv, rewards.flatten(), masks):
        torch.testing.assert_close(a, torch.full((m.numel(),), float(r) - 0.2 * 0.5))
    inputs, *_ = _batch(0, 2, 2)
    with pytest.raises(ValueError, match="values"):
        get_estimator("ppo")(inputs, AdvantageConfig())
    inputs.response_masks = inputs.response_masks[:-1]
    with pytest.raises(ValueError, match="response_masks"):
        get_estimator("grpo")(inputs, AdvantageConfig())


# ------------------------------------------------------------------ whitening

def test_whiten_matches_reference():
    inputs, rewards, masks, kl, _ = _batch(3, 4, 7)
    advs = _ref_rpp(rewards, masks, kl, 0.2, 0.9)
    got = whiten([torch.tensor(a) for a in advs], inputs.response_masks, None)
    _close(got, _ref_whiten(advs, masks))
    trained = torch.cat([g[m > 0] for g, m in zip(got, inputs.response_masks)]).double()
    assert trained.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert trained.std().item() == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ValueError, match="no trained token"):
        whiten([torch.ones(3)], [torch.zeros(3)], None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _whiten_worker(rank: int, world: int, port: int, shards, results) -> None:
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        advs, masks = shards[rank]
        results[rank] = [t.tolist() for t in whiten(advs, masks, torch_dist.group.WORLD)]
    finally:
        torch_dist.destroy_process_group()


@pytest.mark.parametrize("split", [5, 0])
def test_whiten_two_ranks_equals_one_process(split):
    """Each rank whitens its own samples with the global statistics (rank 0 may hold none)."""
    inputs, rewards, masks, kl, _ = _batch(11, 5, 3)
    advs = [torch.tensor(a) for a in _ref_rpp(rewards, masks, kl, 0.3, 0.95)]
    single = whiten(advs, inputs.response_masks, None)
    shards = [(advs[:split], inputs.response_masks[:split]), (advs[split:], inputs.response_masks[split:])]
    local0 = whiten(*shards[0], None) if split and any(m.sum() for m in shards[0][1]) else None
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_whiten_worker, args=(2, _free_port(), shards, results), nprocs=2, join=True)
        results = dict(results)
    _close([torch.tensor(x) for x in results[0] + results[1]], [t.tolist() for t in single])
    if local0 is not None:   # the ranks really used global, not local, statistics
        got0 = torch.cat([torch.tensor(x) for x in results[0]])
        assert not torch.allclose(torch.cat(local0), got0, atol=1e-3)
