"""RL and SFT losses on packed micro-batches (docs/design.md §5, miles semantics).

Per response token, with logp the current policy, old the policy that the
advantages refer to, ref the reference model and rollout the engine:

    ratio = exp(clamp(logp - old, -20, 20))
            (GSPO, --advantage-estimator gspo: the log-ratio is the sample's mean over its
            trained tokens, shared by all of them; gradients flow through the mean)
    pg    = max(-ratio*A, -clamp(ratio, 1-eps_clip, 1+eps_clip_high)*A)
            (dual clip, A < 0 only: pg = min(pg, -c*A))
    pg   *= clamp(exp(old - rollout), tis_clip_low, tis_clip)   (--use-tis; detached)
    KL    = estimator(logp - ref)  (* ratio = exp(logp - old) with --use-unbiased-kl: an unbiased
            estimate of the current policy's KL from samples of the old one. low_var_kl clamps
            the PRODUCT ratio * k3 to [-10, 10], miles' order, which recipes are tuned on;
            clamping k3 first would bound a token's penalty by 10 * ratio instead of 10)
    total = pg + kl_loss_coef * KL - entropy_coef * entropy
            (Dr.GRPO, --loss-agg-mode seq-mean-token-sum-norm: only pg takes the constant
            normalizer; the KL and entropy terms and every metric are plain token means, as miles)

Tokens that carry no loss (weight 0: prompt positions, masked response tokens)
are zeroed before the sum, so a NaN/inf there (e.g. a huge log-ratio on a
masked token) cannot make the loss NaN.

The micro-batch loss is `sum(total * loss_weight)`. The weights (built in
batching.token_loss_weights) already hold the aggregation — a sample's token
mean divided by the global batch size, or one over the step's token count — so
summing micro-batch losses (and gradients) over micro-batches and ranks gives
exactly miles' step objective, however the samples were split.

Metrics are weighted the same way, so summing a LossMetrics over the step's
micro-batches and ranks gives the step's aggregate; they stay 0-d tensors so
the trainer can reduce them with one collective and sync once per step
(types.WeightedSums).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from furlong.algorithms.custom_loss import UserLossFunctions, user_pg_term, user_tis
from furlong.types import MicroBatch, WeightedSums


# log-ratio clamp before exp(): keeps ratios finite for wildly off-policy tokens (as miles).
LOG_RATIO_CLAMP = 20.0
# low_var_kl output clamp (as miles).
LOW_VAR_KL_CLAMP = 10.0


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                eps_clip: float, eps_clip_high: float, eps_clip_c: float | None = None,
                log_ratio: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token.

    Returns (pg [T], clipfrac [T] float: 1 where the clipped branch is the max,
    ppo_kl [T] = old - logp). `log_ratio` overrides logp - old (GSPO's sequence ratio).
    """
    if log_ratio is None:
        log_ratio = log_probs - old_log_probs
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    pg = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        # Dual clip bounds the loss of negative-advantage tokens whose ratio exploded.
        dual = torch.minimum(pg, -eps_clip_c * advantages)
        pg = torch.where(advantages < 0, dual, pg)
    return pg, clipfrac, -log_ratio.detach()


def _kl_k1(d: torch.Tensor) -> torch.Tensor:
    return d


def _kl_k2(d: torch.Tensor) -> torch.Tensor:
    return d * d / 2


def _kl_k3(d: torch.Tensor) -> torch.Tensor:
    return torch.exp(-d) - 1 + d


def _kl_low_var(d: torch.Tensor) -> torch.Tensor:
    # Unclamped here: kl_penalty clamps after the optional importance ratio (miles' order).
    neg = torch.clamp(-d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(neg) - 1 - neg


# Estimators of KL(policy || ref) from d = logp - ref_logp of sampled tokens.
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _kl_k1,
    "k2": _kl_k2,
    "k3": _kl_k3,
    "low_var_kl": _kl_low_var,
}


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str,
               importance_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimate [T] of the kind named by --kl-loss-type, times importance_ratio [T]
    when given (--use-unbiased-kl); low_var_kl's clamp applies to that product (miles)."""
    try:
        fn = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"--kl-loss-type: unknown type {kind!r} ({', '.join(KL_ESTIMATORS)})") from None
    kl = fn(log_probs - ref_log_probs)
    if importance_ratio is not None:
        kl = kl * importance_ratio
    if kind == "low_var_kl":
        kl = torch.clamp(kl, -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    return kl


def tis_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, clip: float,
                clip_low: float = 0.0) -> torch.Tensor:
    """Truncated importance weights [T] = clamp(exp(old - rollout), clip_low, clip), no gradient."""
    return torch.clamp(torch.exp(old_log_probs.detach() - rollout_log_probs), clip_low, clip)


def sequence_mean_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """GSPO: each position gets its sample's mean of log_ratio over the sample's masked-in
    tokens [T] (differentiable; samples bounded by cu_seqlens [N+1], positions past the last are 0)."""
    total = log_ratio.shape[0]
    seg = torch.searchsorted(cu_seqlens[1:].to(log_ratio.device).long(),
                             torch.arange(total, device=log_ratio.device), right=True)   # [T] sample index
    seg = seg.clamp(max=cu_seqlens.numel() - 2)
    num = cu_seqlens.numel() - 1
    m = mask.to(log_ratio.dtype)
    sums = torch.zeros(num, dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, seg, log_ratio * m)
    counts = torch.zeros(num, dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, seg, m)
    return (sums / counts.clamp(min=1))[seg]


@dataclass(frozen=True)
class LossConfig:
    """Loss hyper-parameters (the --eps-clip ... --tis-clip flags); no defaults here: the flags hold
    them, and config_map.loss_config is the one way from the flags to these."""
    eps_clip: float
    eps_clip_high: float
    eps_clip_c: float | None             # dual clip (None: off)
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    entropy_coef: float
    use_tis: bool
    tis_clip: float
    tis_clip_low: float
    use_unbiased_kl: bool
    sequence_ratio: bool                 # GSPO
    user: UserLossFunctions | None = None   # user TIS / pg reducer / custom loss (algorithms/custom_loss.py)


@dataclass
class LossMetrics(WeightedSums):
    """The RL loss's weighted sums of one micro-batch (types.WeightedSums: add them over the step)."""
    loss: torch.Tensor          # [] the optimized objective (detached)
    pg_loss: torch.Tensor       # [] policy-gradient term (after TIS)
    pg_clipfrac: torch.Tensor   # [] fraction of tokens on the clipped branch
    ppo_kl: torch.Tensor        # [] old - logp
    kl_loss: torch.Tensor       # [] KL estimate vs the reference (0 without --use-kl-loss)
    entropy: torch.Tensor       # [] policy entropy (0 when not computed)
    rollout_logprob_abs_diff: torch.Tensor   # [] |trainer - engine| log-prob of the sampled tokens
    ois: torch.Tensor           # [] exp(logp - old): the importance ratio the policy term applies, unclamped
                                # (GSPO: the sequence ratio); miles' "ois", logged with its mismatch metrics


def _wsum(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.where(weight != 0, x.detach().float() * weight, 0.0).sum()


def rl_loss(mb: MicroBatch, log_probs: torch.Tensor, entropy: torch.Tensor | None,
            params: LossConfig, slices: list[tuple[int, int]] | None = None) -> tuple[torch.Tensor, LossMetrics]:
    """Micro-batch RL loss (scalar, sum of weighted per-token totals) and its metrics.

    log_probs [T] and entropy [T] come from the training forward over mb's
    positions (entropy may be None unless entropy_coef != 0). mb.old_log_probs
    None means reuse: old = log_probs.detach() (exact with one step per rollout). `slices`: each packed
    sample's response positions, which the user's TIS function and pg reducer need (custom_loss.py).
    """
    if entropy is None and params.entropy_coef != 0:
        raise ValueError("--entropy-coef: non-zero entropy coefficient needs the entropy of the forward pass")
    if params.use_kl_loss and mb.ref_log_probs is None:
        raise ValueError("--use-kl-loss: micro-batch has no reference log-probs")
    w = mb.loss_weight
    # the KL/entropy terms and every metric are plain means (miles: only the policy term takes the
    # Dr.GRPO reducer); in the other modes these are the same weights
    wm = w if mb.metric_weight is None else mb.metric_weight
    live = w != 0                        # tokens that carry loss; everything else is zeroed before sums
    # Off the live tokens, the other log-probs are replaced by the current ones (log-ratio 0, KL 0),
    # so a NaN/inf there reaches neither the loss nor, through 0 * NaN, the gradient.
    cur = log_probs.detach()
    old = cur if mb.old_log_probs is None else torch.where(live, mb.old_log_probs, cur)
    ref = None if mb.ref_log_probs is None else torch.where(live, mb.ref_log_probs, cur)
    rollout = torch.where(live, mb.rollout_log_probs, old)
    log_ratio = log_probs - old
    if params.sequence_ratio:
        log_ratio = sequence_mean_log_ratio(torch.where(live, log_ratio, 0.0), live, mb.cu_seqlens)
    pg, clipfrac, ppo_kl = policy_loss(log_probs, old, mb.advantages, params.eps_clip, params.eps_clip_high,
                                       params.eps_clip_c, log_ratio=log_ratio)
    user = params.user
    if (user is not None and (user.tis is not None or user.pg_reducer is not None)) and slices is None:
        raise ValueError("rl_loss: the user's TIS function or pg reducer needs the response slices")
    user_mask = torch.ones_like(pg)      # a user TIS function's loss masks (1: the token keeps its terms)
    if params.use_tis and user is not None and user.tis is not None:
        pg, user_mask = user_tis(user, mb, slices, pg, old, rollout)
    elif params.use_tis:
        pg = pg * tis_weights(old, rollout, params.tis_clip, params.tis_clip_low)
    total = pg
    extra = torch.zeros_like(pg)         # the KL and entropy terms alone (Dr.GRPO weighs them apart)
    zero = torch.zeros((), device=w.device)
    kl_metric = zero
    if params.use_kl_loss:
        ratio = (torch.exp(torch.clamp(log_probs - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
                 if params.use_unbiased_kl else None)
        kl = kl_penalty(log_probs, ref, params.kl_loss_type, ratio)
        kl = torch.where(live, kl, 0.0)
        total = total + params.kl_loss_coef * kl
        extra = extra + params.kl_loss_coef * kl
        kl_metric = _wsum(kl, wm)
    if params.entropy_coef != 0:
        total = total - params.entropy_coef * entropy
        extra = extra - params.entropy_coef * entropy
    if user is not None and user.tis is not None:   # its masks drop tokens from every term (miles' reducer)
        total, extra = total * user_mask, extra * user_mask
    if user is not None and user.pg_reducer is not None:   # the policy term under the user's reducer
        pg_term = user_pg_term(user, mb, slices, torch.where(live, pg, 0.0), user_mask, wm)
        loss = pg_term + (torch.where(live, extra, 0.0) * wm).sum()
    elif mb.metric_weight is None:
        loss = (torch.where(live, total, 0.0) * w).sum()
    else:   # the policy term under the reducer's weights, the KL/entropy terms as plain means
        loss = (torch.where(live, pg, 0.0) * w).sum() + (torch.where(live, extra, 0.0) * wm).sum()
    metrics = LossMetrics(
        loss=loss.detach().float(),
        pg_loss=_wsum(pg, wm),
        pg_clipfrac=_wsum(clipfrac, wm),
        ppo_kl=_wsum(ppo_kl, wm),
        kl_loss=kl_metric,
        entropy=zero if entropy is None else _wsum(entropy, wm),
        rollout_logprob_abs_diff=_wsum((cur - rollout).abs(), wm),
        ois=_wsum(torch.exp(-ppo_kl), wm),
    )
    return loss, metrics


def sft_loss(mb: MicroBatch, log_probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with the same aggregation weights: -sum(log_probs * loss_weight)."""
    return -(log_probs * mb.loss_weight).sum()
