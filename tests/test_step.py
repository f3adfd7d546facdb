"""The step's stages from kept groups to trainer samples (run/step.py): each estimator and flag
reaches the advantages and log-probs the loss sees (a fake actor supplies the log-prob passes)."""
from __future__ import annotations

import pytest
import torch

from furlong.config import Config
from furlong.config_checks import validate
from furlong.algorithms.advantages import AdvantageConfig, AdvantageInputs, get_estimator, whiten
from furlong.algorithms.shaping import overlong_penalty
from furlong.run import step
from furlong.config_map import advantage_config, batching_config, shaping_config
from furlong.types import Group, Prompt, Sample


class FakeActor:
    def __init__(self):
        self.calls = []

    def compute_log_probs(self, samples, steps, which: str):
        self.calls.append(which)
        shift = -0.5 if which == "old" else -0.8
        return [torch.full((s.num_response_tokens,), shift) + 0.01 * torch.arange(s.num_response_tokens)
                for s in samples]


def groups(seed=0, num=3, n=4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(num):
        p = Prompt(row=gi, raw="", text="", token_ids=[1, 2, 3], label="")
        samples = []
        for j in range(n):
            r = int(torch.randint(1, 12, (1,), generator=g))
            samples.append(Sample(prompt=p, group_id=gi, index=j, response_ids=[5] * r, response_text="",
                                  rollout_log_probs=(-torch.rand(r, generator=g)).tolist(),
                                  finish_reason="stop", reward=float(torch.randint(0, 2, (1,), generator=g))))
        out.append(Group(gi, samples))
    return out


def build_train_samples(gs, c: Config, actor, num_optimizer_steps: int = 1):
    """The stages from rewards to advantages, in rl_step's order."""
    a, steps = c.algo, batching_config(c)
    passes = step.log_prob_passes(a.use_rollout_logprobs, a.use_kl_loss, a.kl_coef, a.skip_actor_forward_only,
                                  num_optimizer_steps)
    samples, rewards = step.train_samples(gs, shaping_config(c))
    step.old_log_probs(samples, actor, steps, passes.old)
    step.ref_log_probs(samples, actor, steps, passes.ref)
    step.advantages(samples, rewards, advantage_config(c))
    return samples


def cfg(**algo) -> Config:
    c = Config()
    c.rollout.rollout_max_response_len = 12
    for k, v in algo.items():
        setattr(c.algo, k, v)
    return c


@pytest.mark.parametrize("name", ["grpo", "gspo", "rloo"])
def test_scalar_estimators_reach_the_samples(name):
    gs = groups()
    actor = FakeActor()
    samples = build_train_samples(gs, cfg(advantage_estimator=name), actor)
    rewards = torch.tensor([grp.rewards for grp in gs])
    masks = [torch.ones(s.num_response_tokens) for s in samples]
    want, _ = get_estimator(name)(AdvantageInputs(rewards, masks, None), AdvantageConfig())
    for s, w in zip(samples, want):
        torch.testing.assert_close(s.advantages, w)
        assert s.old_log_probs is None and s.ref_log_probs is None     # reused from the training forward
    assert actor.calls == []


def test_reinforce_pp_kl_in_reward_needs_old_and_ref_and_is_whitened():
    gs = groups(1)
    actor = FakeActor()
    c = cfg(advantage_estimator="reinforce_plus_plus", kl_coef=0.1, gamma=0.9)
    samples = build_train_samples(gs, c, actor)
    assert actor.calls == ["old", "ref"]                    # the reward's KL needs both before training
    kl = [s.old_log_probs - s.ref_log_probs for s in samples]   # k1 (the default --kl-loss-type)
    masks = [torch.ones(s.num_response_tokens) for s in samples]
    raw, _ = get_estimator("reinforce_plus_plus")(
        AdvantageInputs(torch.tensor([grp.rewards for grp in gs]), masks, kl), AdvantageConfig(kl_coef=0.1, gamma=0.9))
    for s, w in zip(samples, whiten(raw, masks, None)):
        torch.testing.assert_close(s.advantages, w)
    allv = torch.cat([s.advantages for s in samples])
    assert abs(allv.mean().item()) < 1e-5


def test_flags_rollout_logprobs_overlong_normalize_and_raw_rewards():
    gs = groups(2)
    actor = FakeActor()
    samples = build_train_samples(gs, cfg(use_rollout_logprobs=True), actor, num_optimizer_steps=2)
    assert actor.calls == [] and all(torch.equal(s.old_log_probs, s.rollout_log_probs) for s in samples)

    c = cfg(overlong_buffer_len=4, overlong_penalty_factor=2.0, disable_rewards_normalization=True)
    samples = build_train_samples(gs, c, FakeActor())
    flat = [s for grp in gs for s in grp.samples]
    for s, smp in zip(samples, flat):
        want = smp.reward + overlong_penalty(len(smp.response_ids), 12, 4, 2.0)
        torch.testing.assert_close(s.advantages, torch.full((len(smp.response_ids),), want))
    assert any(len(smp.response_ids) > 8 for smp in flat)    # some responses were penalized

    samples = build_train_samples(gs, cfg(normalize_advantages=True), FakeActor())
    allv = torch.cat([s.advantages for s in samples])
    assert abs(allv.mean().item()) < 1e-5 and allv.std().item() == pytest.approx(1.0, rel=1e-3)


def test_several_optimizer_steps_take_old_log_probs_from_a_forward():
    actor = FakeActor()
    samples = build_train_samples(groups(3), cfg(), actor, num_optimizer_steps=2)
    assert actor.calls == ["old"] and all(s.old_log_probs is not None and s.ref_log_probs is None for s in samples)


def _flags(**batch_and_algo) -> Config:
    """A valid `furlong train` flag set (4 groups of 1 sample) with `batch_and_algo` set."""
    c = Config()
    c.data.hf_checkpoint, c.data.prompt_data, c.reward.rm_type, c.rollout.rollout_batch_size = "x", "x", "math", 4
    for k, v in batch_and_algo.items():
        setattr(c.batch if hasattr(c.batch, k) else c.algo, k, v)
    return c


def test_reuse_flag_rejected_with_several_steps():
    cfg = _flags(global_batch_size=2, skip_actor_forward_only=True)
    with pytest.raises(ValueError, match="--skip-actor-forward-only"):
        validate(cfg)
    validate(_flags(global_batch_size=4, skip_actor_forward_only=True))


def test_log_prob_passes():
    """Which passes a step runs: one decision from the flags and the optimizer steps per rollout."""
    assert step.log_prob_passes(False, False, 0.0, None, 1).old == "training"
    assert step.log_prob_passes(False, False, 0.0, None, 2).old == "forward"
    assert step.log_prob_passes(False, False, 0.0, False, 1).old == "forward"
    assert step.log_prob_passes(True, False, 0.0, None, 2).old == "engine"
    assert step.log_prob_passes(False, True, 0.0, None, 1).ref and not step.log_prob_passes(False, False, 0.0, None, 1).ref
    kl_reward = step.log_prob_passes(False, False, 0.1, None, 1)   # the reward's KL needs both before training
    assert kl_reward.old == "forward" and kl_reward.ref


def test_overlong_penalty_formula():
    assert overlong_penalty(8, 12, 4, 1.0) == 0.0
    assert overlong_penalty(10, 12, 4, 1.0) == -0.5
    assert overlong_penalty(12, 12, 4, 2.0) == -2.0
