"""User functions for the --custom-* loss and reward flags in tests/test_train_flags_cli.py, written to
miles' signatures (algorithms/custom_loss.py, run/reward_post_process.py). Each correct one re-implements
what furlong does by default, so a run with it must train exactly like a run without it."""
from __future__ import annotations

import torch

# --rollout-max-response-len of the tests: a constant divisor that makes the reducer Dr.GRPO's
DIVISOR = 6.0


def ppo_loss(args, batch, log_probs, entropy, sum_of_sample_mean):
    """The PPO clipped policy loss of losses.policy_loss (no KL, no entropy, no TIS), from miles' batch keys."""
    logp = torch.cat(log_probs)
    old = torch.cat(batch["log_probs"])
    adv = torch.cat(batch["advantages"])
    mask = torch.cat(batch["loss_masks"])
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    hi = args.eps_clip if args.eps_clip_high is None else args.eps_clip_high
    pg = torch.maximum(-ratio * adv, -torch.clamp(ratio, 1 - args.eps_clip, 1 + hi) * adv)
    pg_loss = sum_of_sample_mean(pg * mask)
    return pg_loss, {"pg_loss": pg_loss.detach(), "entropy_loss": sum_of_sample_mean(torch.cat(entropy).detach())}


def loss_returning_text(args, batch, log_probs, entropy, sum_of_sample_mean):
    return "not a loss"


def loss_with_unknown_metric(args, batch, log_probs, entropy, sum_of_sample_mean):
    loss = sum_of_sample_mean(-torch.cat(log_probs))
    return loss, {"my_metric": loss.detach()}


def vanilla_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """miles' vanilla_tis_function."""
    tis = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weights = torch.clamp(tis, min=args.tis_clip_low, max=args.tis_clip)
    return pg_loss * weights, loss_masks, {"tis": tis.detach()}


def tis_dropping_masks(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    return pg_loss, loss_masks[:-1], {}


def sample_mean_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """miles' default sum_of_sample_mean (the sum over samples of each sample's token mean)."""
    def reduce(x):
        return sum((x_i * m_i).sum() / m_i.sum().clamp(min=1)
                   for x_i, m_i in zip(x.split(response_lengths), loss_masks))
    return reduce


def constant_divisor_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """miles' examples/experimental/DrGRPO reducer: token sums over a constant."""
    def reduce(x):
        return sum((x_i * m_i).sum() / DIVISOR for x_i, m_i in zip(x.split(response_lengths), loss_masks))
    return reduce


def grpo_rewards(args, samples):
    """miles' default post-processing for grpo: each group's rewards less the group mean, over the std."""
    raw = [float(s.reward) for s in samples]
    n = args.n_samples_per_prompt
    out = []
    for g in range(0, len(raw), n):
        group = torch.tensor(raw[g:g + n])
        centered = group - group.mean()
        std = group.std()
        out += (centered / (std + 1e-6) if n > 1 and std > 0 else centered).tolist()
    return raw, out


def rewards_too_short(args, samples):
    return [0.0], [0.0]


# Variants that change the objective: a run with one must NOT train like furlong's default (the
# equivalence tests above would pass for an ignored function too; these would not).

def ppo_loss_negated(args, batch, log_probs, entropy, sum_of_sample_mean):
    """(A scaled loss would not do: Adam's step does not see the scale.)"""
    loss, metrics = ppo_loss(args, batch, log_probs, entropy, sum_of_sample_mean)
    return -loss, metrics


def tis_zero(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """Every token's mask set to 0: no policy term at all."""
    return pg_loss, [m * 0 for m in loss_masks], {}


def first_tokens_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    """Only each sample's first 3 response tokens count."""
    def reduce(x):
        return sum((x_i[:3] * m_i[:3]).sum() / m_i[:3].sum().clamp(min=1)
                   for x_i, m_i in zip(x.split(response_lengths), loss_masks))
    return reduce


def reversed_rewards(args, samples):
    raw, rewards = grpo_rewards(args, samples)
    return raw, [-r for r in rewards]
