"""Tool/environment tokens (loss mask 0) get exactly zero gradient from the policy loss, the KL loss and
the entropy bonus, count in no token total (--calculate-per-token-loss), and a Sample's mask reaches the
TrainSample (run/step.py's train_samples), whose advantages are whitened over trained tokens only."""
from __future__ import annotations

import torch

from furlong.algorithms.losses import LossConfig, rl_loss
from furlong.algorithms.advantages import AdvantageConfig
from furlong.algorithms.shaping import ShapingConfig
from furlong.run import step
from furlong.trainer.batching import num_loss_tokens, pack_micro_batch, step_loss_weights
from furlong.types import Group, Prompt, Sample, TrainSample


def _sample(mask: list[int], seed: int) -> TrainSample:
    g = torch.Generator().manual_seed(seed)
    r = len(mask)
    return TrainSample(token_ids=torch.randint(0, 50, (3 + r,), generator=g), num_prompt_tokens=3,
                       advantages=torch.randn(r, generator=g), rollout_log_probs=-torch.rand(r, generator=g),
                       old_log_probs=-torch.rand(r, generator=g), ref_log_probs=-torch.rand(r, generator=g),
                       loss_mask=torch.tensor(mask, dtype=torch.float32))


def test_masked_tokens_get_zero_gradient_and_no_count():
    samples = [_sample([1, 1, 0, 0, 0, 1], 0), _sample([1, 0, 0, 1], 1)]
    assert num_loss_tokens(samples) == 5
    for per_token in (False, True):
        weights = step_loss_weights(samples, "seq-mean-token-mean", per_token, 16)
        mb = pack_micro_batch(samples, weights, [0, 1])
        log_probs = (-torch.rand(mb.num_tokens)).requires_grad_()
        entropy = torch.rand(mb.num_tokens).requires_grad_()
        params = LossConfig(eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0, use_kl_loss=True, kl_loss_coef=0.1,
                            kl_loss_type="low_var_kl", entropy_coef=0.01, use_tis=True, tis_clip=2.0,
                            tis_clip_low=0.0, use_unbiased_kl=True, sequence_ratio=False)
        loss, _ = rl_loss(mb, log_probs, entropy, params)
        loss.backward()
        trained = mb.response_mask.bool()
        assert int(trained.sum()) == 5
        assert torch.all(log_probs.grad[~trained] == 0) and torch.all(entropy.grad[~trained] == 0)
        assert torch.all(log_probs.grad[trained] != 0) and torch.all(entropy.grad[trained] != 0)
        if per_token:   # every trained token weighs 1/5, whichever sample it is in
            torch.testing.assert_close(mb.loss_weight[trained], torch.full((5,), 0.2))


def test_sample_mask_reaches_train_sample():
    prompt = Prompt(row=0, raw="q", text="q", token_ids=[1, 2], label="")
    samples = []
    for j in range(3):
        s = Sample(prompt=prompt, group_id=0, index=j, response_ids=[], response_text="", rollout_log_probs=[],
                   finish_reason="pending", reward=float(j))
        s.add_model_tokens([5, 6], [-0.1, -0.2], "ab")
        s.add_tool_tokens([7, 8, 9][:3 - j], "cde")     # tool outputs of different lengths
        s.add_model_tokens([10], [-0.3], "f")
        samples.append(s)
    assert samples[0].num_turns == 2 and samples[0].num_trained_tokens == 3 and samples[0].tokens[-1] == 10
    out, rewards = step.train_samples([Group(0, samples)], ShapingConfig(None, 1.0, 16))
    step.old_log_probs(out, None, None, "engine")
    step.advantages(out, rewards, AdvantageConfig(estimator="grpo", whiten=True))
    assert out[0].loss_mask.tolist() == [1, 1, 0, 0, 0, 1] and out[2].loss_mask.tolist() == [1, 1, 0, 1]
    assert out[0].rollout_log_probs.tolist()[2:5] == [0.0, 0.0, 0.0]
    # whitening's statistics count the trained tokens only: their mean is 0, whatever the tool lengths
    trained = torch.cat([s.advantages[s.loss_mask.bool()] for s in out])
    assert trained.numel() == 9 and abs(float(trained.mean())) < 1e-6
