"""Loss weights and packing of a step's samples into micro-batches.

Planning (which samples share a micro-batch, and which rank gets which
samples) lives in planning.py.

Loss weights (`token_loss_weights`) carry the step's aggregation so that
micro-batch losses simply add up (see losses.py):
  default  : weight = mask / (num_masked_tokens(sample) * global_batch_size)   (seq-mean-token-mean)
  per-token: weight = mask / global_num_loss_tokens  (all ranks' micro-batches; token-mean, DAPO)
  constant : weight = mask / (constant_len * global_batch_size)  (seq-mean-token-sum-norm, Dr.GRPO:
             a token sum over a constant, the max response length, so long and short responses'
             tokens weigh the same)

Packing (`pack_micro_batch`): samples are concatenated into one row. Position
t predicts targets[t]; for a sample with P prompt tokens, response token j is
predicted at position P-1+j of that sample, where its weight, advantage and
log-probs are placed.
"""
from __future__ import annotations

import torch

from furlong.types import MicroBatch, TrainSample


# --------------------------------------------------------------------------- loss weights

def _mask(s: TrainSample) -> torch.Tensor:
    if s.loss_mask is None:
        return torch.ones(s.num_response_tokens, dtype=torch.float32, device=s.token_ids.device)
    return s.loss_mask.float()


def num_loss_tokens(samples: list[TrainSample]) -> int:
    """Trained (mask = 1) response tokens of these samples; all-reduce it for per-token mode."""
    # CPU-side bookkeeping before the step: the masks live on the host here.
    return int(sum(float(_mask(s).sum()) for s in samples))


def token_loss_weights(samples: list[TrainSample], global_batch_size: int, per_token: bool,
                       global_num_response_tokens: int, constant_len: int | None = None) -> list[torch.Tensor]:
    """Aggregation weight [R] of each response token of each sample (see module docstring).

    global_num_response_tokens (per-token mode only) counts the trained tokens of
    the whole optimizer step on all ranks (num_loss_tokens, all-reduced).
    constant_len (Dr.GRPO's constant normalizer) replaces each sample's token count.
    """
    if global_batch_size < 1:
        raise ValueError(f"--global-batch-size: must be >= 1, got {global_batch_size}")
    out = []
    for s in samples:
        m = _mask(s)
        if m.numel() != s.num_response_tokens:
            raise ValueError(f"loss_mask: length {m.numel()} != {s.num_response_tokens} response tokens")
        if constant_len is not None:
            out.append(m / (constant_len * global_batch_size))
        elif per_token:
            out.append(m / max(global_num_response_tokens, 1))
        else:
            # clamp: a fully masked sample gets zero weights instead of 0/0.
            out.append(m / (m.sum().clamp(min=1) * global_batch_size))
    return out


def step_loss_weights(samples: list[TrainSample], loss_agg_mode: str, calculate_per_token_loss: bool,
                      max_response_len: int) -> list[torch.Tensor]:
    """token_loss_weights for one optimizer step's samples (all ranks' share) under --loss-agg-mode."""
    per_token = calculate_per_token_loss or loss_agg_mode == "token-mean"
    constant = max_response_len if loss_agg_mode == "seq-mean-token-sum-norm" else None
    return token_loss_weights(samples, len(samples), per_token, num_loss_tokens(samples) if per_token else 0, constant)


def step_metric_weights(samples: list[TrainSample], loss_agg_mode: str) -> list[torch.Tensor] | None:
    """Dr.GRPO (seq-mean-token-sum-norm) only: the per-sample token-mean weights [R] of the KL and entropy
    terms and of the metrics (miles' reducer changes only the policy term); None in the other modes."""
    if loss_agg_mode != "seq-mean-token-sum-norm":
        return None
    return token_loss_weights(samples, len(samples), False, 0)


# --------------------------------------------------------------------------- packing

def _place(values: list[torch.Tensor], starts: list[int], total: int) -> torch.Tensor:
    out = torch.zeros(total, dtype=torch.float32)
    for v, s in zip(values, starts):
        out[s:s + v.numel()] = v.float().cpu()
    return out


def pack_micro_batch(samples: list[TrainSample], weights: list[torch.Tensor],
                     indices: list[int], metric_weights: list[torch.Tensor] | None = None) -> MicroBatch:
    """Pack samples[i] for i in indices (samples/weights: the step's full lists) into one row."""
    chosen = [samples[i] for i in indices]
    if not chosen:   # the planners never make an empty micro-batch; a short rank pads with padding_micro_batch
        raise ValueError("pack_micro_batch: no samples")
    has_old = [s.old_log_probs is not None for s in chosen]
    has_ref = [s.ref_log_probs is not None for s in chosen]
    if len(set(has_old)) > 1 or len(set(has_ref)) > 1:
        raise ValueError("micro-batch mixes samples with and without old/ref log-probs")
    lens, starts, resp_starts = [], [], []
    pos = 0
    for i, s in zip(indices, chosen):
        if s.num_prompt_tokens < 1:
            raise ValueError(f"sample {i}: needs at least one prompt token")
        if weights[i].numel() != s.num_response_tokens:
            raise ValueError(f"sample {i}: weights length {weights[i].numel()} != {s.num_response_tokens}")
        lens.append(s.num_tokens)
        starts.append(pos)
        resp_starts.append(pos + s.num_prompt_tokens - 1)
        pos += s.num_tokens
    total = pos
    input_ids = torch.cat([s.token_ids.long().cpu() for s in chosen])
    targets = torch.zeros(total, dtype=torch.long)
    for s, st, n in zip(chosen, starts, lens):
        targets[st:st + n - 1] = s.token_ids[1:].long().cpu()
    position_ids = torch.cat([torch.arange(n, dtype=torch.long) for n in lens])
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seqlens=cu,
        max_seqlen=max(lens),
        targets=targets,
        loss_weight=_place([weights[i] for i in indices], resp_starts, total),
        response_mask=_place([_mask(s) for s in chosen], resp_starts, total),
        advantages=_place([s.advantages for s in chosen], resp_starts, total),
        old_log_probs=_place([s.old_log_probs for s in chosen], resp_starts, total) if has_old[0] else None,
        rollout_log_probs=_place([s.rollout_log_probs for s in chosen], resp_starts, total),
        ref_log_probs=_place([s.ref_log_probs for s in chosen], resp_starts, total) if has_ref[0] else None,
        sample_indices=list(indices),
        metric_weight=None if metric_weights is None else _place([metric_weights[i] for i in indices], resp_starts, total),
    )


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t on `device` without making the host wait for the device: to a GPU, through pinned memory
    (a copy from pageable memory may wait for the stream's queued work, and a train step queues
    ~1 s of it; pinned, the seed step's copy calls took 8 ms of host time instead of 92 ms on the
    H200). The pinned staging copy is freed once the transfer has run."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def move_micro_batch(mb: MicroBatch, device: torch.device | str) -> MicroBatch:
    """Copy of mb with every tensor on `device` (see to_device)."""
    mv = lambda t: None if t is None else to_device(t, device)  # noqa: E731
    return MicroBatch(
        input_ids=mv(mb.input_ids), position_ids=mv(mb.position_ids), cu_seqlens=mv(mb.cu_seqlens),
        max_seqlen=mb.max_seqlen, targets=mv(mb.targets), loss_weight=mv(mb.loss_weight),
        response_mask=mv(mb.response_mask), advantages=mv(mb.advantages),
        old_log_probs=mv(mb.old_log_probs), rollout_log_probs=mv(mb.rollout_log_probs),
        ref_log_probs=mv(mb.ref_log_probs), sample_indices=list(mb.sample_indices), metric_weight=mv(mb.metric_weight),
    )


# --------------------------------------------------------------------------- padding and response positions

def padding_micro_batch(has_old: bool, has_ref: bool) -> MicroBatch:
    """One token, zero weight: a rank with fewer micro-batches than the others pads with it to join
    the FSDP collectives."""
    z = lambda: torch.zeros(1, dtype=torch.float32)  # noqa: E731
    return MicroBatch(
        input_ids=torch.zeros(1, dtype=torch.long), position_ids=torch.zeros(1, dtype=torch.long),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32), max_seqlen=1, targets=torch.zeros(1, dtype=torch.long),
        loss_weight=z(), response_mask=z(), advantages=z(), old_log_probs=z() if has_old else None,
        rollout_log_probs=z(), ref_log_probs=z() if has_ref else None, sample_indices=[],
    )


def response_slices(mb: MicroBatch, samples: list[TrainSample]) -> list[tuple[int, int]]:
    """(start, end) in mb's positions of each packed sample's response log-probs."""
    out = []
    for k, i in enumerate(mb.sample_indices):
        start = int(mb.cu_seqlens[k]) + samples[i].num_prompt_tokens - 1
        out.append((start, start + samples[i].num_response_tokens))
    return out


def response_positions(slices: list[tuple[int, int]]) -> torch.Tensor:
    """[R_total] int64 packed positions whose hidden states predict response tokens (host side)."""
    if not slices:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(s, e, dtype=torch.long) for s, e in slices])
