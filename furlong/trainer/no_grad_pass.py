"""One no-grad forward over a rollout's samples, each rank its share, then all-gathered.

Old log-probs and reference log-probs (actor.py) and the critic's values (critic.py) are the same
pass with a different per-position function: every rank plans the same rank split and micro-batches
(planning.py), runs its own micro-batches (a rank short of micro-batches runs a one-token padding
micro-batch, so that every rank joins every FSDP all-gather), reshards the model afterwards (a
no-grad forward has no backward to do it, fsdp.py), and one all-gather of flat tensors gives every
rank every sample's response values: every rank knows every rank's sample order and sizes.
"""
from __future__ import annotations

from typing import Callable

import torch

from furlong.launch.distributed import all_gather_flat
from furlong.trainer.batching import move_micro_batch, pack_micro_batch, padding_micro_batch, response_slices
from furlong.trainer.fsdp import reshard_all
from furlong.types import DistContext, MicroBatch, TrainSample

# (micro-batch on the device, each packed sample's response (start, end) in it) -> values [T]
PositionFn = Callable[[MicroBatch, list[tuple[int, int]]], torch.Tensor]
RankPlan = tuple[list[list[int]], list[list[list[int]]]]   # rank split, per-rank micro-batches (planning.py)


@torch.no_grad()
def gathered_forward(model: torch.nn.Module, samples: list[TrainSample], plan: RankPlan, ctx: DistContext,
                     forward: PositionFn) -> list[torch.Tensor]:
    """Per sample, `forward`'s values [R] at its response positions (fp32, CPU), on every rank."""
    split, plans = plan
    zero_w = [torch.zeros(s.num_response_tokens) for s in samples]
    mine, num_mb = plans[ctx.rank], max(len(p) for p in plans)
    out: dict[int, torch.Tensor] = {}
    for k in range(num_mb):
        mb = pack_micro_batch(samples, zero_w, mine[k]) if k < len(mine) else padding_micro_batch(False, False)
        slices = response_slices(mb, samples)  # from the host copy: no device sync
        values = forward(move_micro_batch(mb, ctx.device), slices)
        for i, (s, e) in zip(mb.sample_indices, slices):
            out[i] = values[s:e]
    # the root (and, without --fsdp-reshard-after-forward, every layer) stays gathered after a forward
    reshard_all(model)
    local = [out[i] for i in split[ctx.rank]]
    flat = torch.cat(local) if local else torch.zeros(0, device=ctx.device)
    sizes = [sum(samples[i].num_response_tokens for i in idx) for idx in split]
    result: list[torch.Tensor] = [torch.empty(0)] * len(samples)
    for idx, gathered in zip(split, all_gather_flat(flat, sizes)):
        for i, part in zip(idx, gathered.split([samples[i].num_response_tokens for i in idx])):
            result[i] = part.float().clone()
    return result
