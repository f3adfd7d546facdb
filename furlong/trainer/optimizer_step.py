"""The end of an optimizer step, shared by the actor and the critic (docs/design.md §2 step 6).

Clip the global gradient norm, sum the step's loss metrics over ranks, bring both to the host in
ONE copy (the step's one host sync: the metrics are logged, and a non-finite norm must skip the
update), then step the optimizer unless the norm is non-finite (the norm is global, so every rank
decides alike), and the LR schedule in any case.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def finish_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, stacked: torch.Tensor,
                clip_grad: float, world_size: int, who: str) -> tuple[list[float], float, float]:
    """(per-rank-summed metrics [M] on the host, grad norm, lr used by this step).

    stacked [M]: this rank's loss metrics (LossMetrics.stacked()); clip_grad <= 0 means no clipping.
    """
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad if clip_grad > 0 else math.inf)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    if world_size > 1:
        dist.all_reduce(stacked)
    host = torch.cat([stacked, grad_norm.reshape(1).float().to(stacked.device)]).tolist()
    norm, lr = host[-1], scheduler.get_last_lr()[0]
    if math.isfinite(norm):
        optimizer.step()
    else:
        log.warning("%s: skipping optimizer step: grad norm is %s", who, norm)
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return host[:-1], norm, lr
