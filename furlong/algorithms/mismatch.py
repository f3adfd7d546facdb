"""--get-mismatch-metrics: how far the engine's log-probs of the sampled tokens are from the trainer's
(same weights: the gap is numerics, kernels and dtypes), as miles reports them; the loss is unchanged.

Per sample, over its trained tokens (loss mask 1), with t = trainer and r = engine log-probs:
  train_rollout_logprob_abs_diff   mean |t - r|                        (miles' loss, always logged there)
  train_rollout_kl                 mean low_var_kl(r || t): k3 of t - r, clamped as miles
  mis_training_log_ppl / _ppl      -mean t, exp of it
  mis_rollout_log_ppl / _ppl       -mean r, exp of it
  mis_kl                           mean (r - t)
  mis_k3_kl                        mean exp(t - r) - (t - r) - 1
  mis_log_ppl_diff / _abs_diff     mean r - mean t, and its absolute value
  mis_ppl_ratio                    exp(mean r - mean t)
  mis_chi2_token                   mean exp(clamp(t - r, ±20))^2 - 1
  mis_chi2_seq                     exp(2 clamp(sum (t - r), ±20)) - 1
(the mis_* set is miles' mismatch helper, examples/infra_features/train_infer_mismatch_helper). Each is
then averaged over samples: miles' default reducer (a token mean over the batch under
--calculate-per-token-loss). Deviation from miles: miles needs --custom-tis-function-path naming that
helper; furlong computes the set itself.

Beside them, with --get-mismatch-metrics or --use-tis (when miles logs it), `train/ois`: the mean over
the trained tokens of exp(logp - old), the policy's new/old importance ratio, unclamped, with old the
policy term's old log-probs (the engine's under --use-rollout-logprobs; GSPO: the sequence ratio). It
needs the training forward, so the loss computes it (algorithms/losses.py LossMetrics.ois), averaged
over the rollout's optimizer steps like train/ppo_kl; under --loss-type custom_loss it is what the
user's function reports as "ois" (0 if none).
"""
from __future__ import annotations

import torch

from furlong.algorithms.losses import LOG_RATIO_CLAMP, kl_penalty


def _per_sample(t: torch.Tensor, r: torch.Tensor, m: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(token-level metrics [R] and sequence-level ones expanded to [R], mask [R]) of one sample."""
    num = m.sum().clamp_min(1)
    mean = lambda x: (x * m).sum() / num  # noqa: E731
    d = t - r
    mean_t, mean_r = mean(t), mean(r)
    rho = torch.exp(torch.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    ones = torch.ones_like(t)
    per_token = {
        "train_rollout_logprob_abs_diff": d.abs(),
        "train_rollout_kl": kl_penalty(r, t, "low_var_kl"),
        "mis_training_log_ppl": -mean_t * ones, "mis_training_ppl": torch.exp(-mean_t) * ones,
        "mis_rollout_log_ppl": -mean_r * ones, "mis_rollout_ppl": torch.exp(-mean_r) * ones,
        "mis_kl": -d, "mis_k3_kl": torch.exp(d) - d - 1,
        "mis_log_ppl_diff": (mean_r - mean_t) * ones, "mis_log_ppl_abs_diff": (mean_r - mean_t).abs() * ones,
        "mis_ppl_ratio": torch.exp(mean_r - mean_t) * ones,
        "mis_chi2_token": (mean(rho * rho) - 1) * ones,
        "mis_chi2_seq": (torch.exp(2 * torch.clamp((d * m).sum(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) - 1) * ones,
    }
    return per_token, m


def mismatch_metrics(train_log_probs: list[torch.Tensor], rollout_log_probs: list[torch.Tensor],
                     loss_masks: list[torch.Tensor], per_token: bool = False) -> dict[str, float]:
    """The module docstring's metrics over a batch: lists of [R_i] tensors per sample."""
    rows = [_per_sample(t.float(), r.float(), m.float())
            for t, r, m in zip(train_log_probs, rollout_log_probs, loss_masks)]
    if not rows:
        return {}
    out = {}
    for key in rows[0][0]:
        if per_token:
            out[key] = float(sum((v[key] * m).sum() for v, m in rows) / max(sum(m.sum() for _, m in rows), 1))
        else:
            out[key] = float(sum((v[key] * m).sum() / m.sum().clamp_min(1) for v, m in rows) / len(rows))
    return out
