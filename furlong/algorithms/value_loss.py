"""The critic's objective and its diagnostics (docs/design.md §5, miles semantics).

Per response token, with v the critic's current value, v_old its value before the
rollout's updates (the one GAE used), R the GAE return and c = --value-clip:

    v_clip    = v_old + clamp(v - v_old, -c, c)
    loss_t    = max((v_clip - R)^2, (v - R)^2)
    clipped_t = |v - v_old| > c

aggregated like the policy loss: sum_t w_t * loss_t with the step's loss weights
(batching.token_loss_weights: a sample's token mean over the global batch size, or one
over the step's token count), so micro-batch losses and gradients add up over
micro-batches and ranks. This is miles' value_loss_function. verl differs: it scales the
loss by 0.5 and counts a token as clipped when the clipped branch is the larger loss.

Explained variance 1 - Var(R - v_old) / Var(R) over the trained tokens says how much of
the returns the critic's (pre-update) values account for: 1 perfect, 0 no better than a
constant, < 0 worse. Bessel's correction cancels in the ratio; it is NaN (logged as null)
when the returns are constant.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from furlong.types import WeightedSums


@dataclass
class ValueLossMetrics(WeightedSums):
    """The value loss's weighted sums of one micro-batch (types.WeightedSums: add them over the step)."""
    value_loss: torch.Tensor       # [] the clipped squared error
    value_clipfrac: torch.Tensor   # [] share of tokens whose value moved further than --value-clip


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, weight: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, ValueLossMetrics]:
    """Clipped value loss (scalar, sum of weighted per-token losses) and its metrics.

    values [T] (with grad), old_values [T], returns [T], weight [T] (0 off the trained response
    tokens). Positions of zero weight are zeroed before the sum, so garbage there (a NaN
    return on a padding position) reaches neither the loss nor the gradient.
    """
    live = weight != 0
    old = torch.where(live, old_values, values.detach())
    ret = torch.where(live, returns, values.detach())
    clipped = old + (values - old).clamp(-clip, clip)
    per_token = torch.maximum((clipped - ret) ** 2, (values - ret) ** 2)
    loss = (torch.where(live, per_token, 0.0) * weight).sum()
    moved = ((values.detach() - old).abs() > clip).float()
    return loss, ValueLossMetrics(value_loss=loss.detach().float(),
                                  value_clipfrac=torch.where(live, moved * weight, 0.0).sum().float())


def explained_variance(values: list[torch.Tensor], returns: list[torch.Tensor],
                       masks: list[torch.Tensor]) -> float:
    """1 - Var(returns - values) / Var(returns) over masked-in tokens (float64); NaN when
    there is no token or the returns are constant. Lists of [R_i] tensors, one per sample:
    every rank holds the whole batch, so the statistic is global without a collective."""
    if not values:
        return float("nan")
    v = torch.cat([x.reshape(-1) for x in values]).double()
    r = torch.cat([x.reshape(-1) for x in returns]).double()
    m = torch.cat([x.reshape(-1) for x in masks]).double()
    n = m.sum()
    if n == 0:
        return float("nan")

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * m).sum() / n
        return (m * (x - mean) ** 2).sum() / n

    var_r = var(r)
    if var_r == 0:
        return float("nan")
    return float(1.0 - var(r - v) / var_r)
