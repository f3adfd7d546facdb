"""Token log-probs and entropy from final hidden states, in chunks (DESIGN.md §5).

For positions t: z_t = (h_t @ W^T) / temperature in fp32, logp_t = z_t[y_t] -
logsumexp(z_t), entropy_t = logsumexp(z_t) - sum_v p_tv z_tv with p = softmax(z_t).

The fp32 [T, V] logits of a whole micro-batch are never materialized (that
ran miles out of memory at 65536 tokens): forward walks over chunks of
`chunk_size` positions and keeps only per-token logsumexp (and entropy);
backward recomputes each chunk's logits and turns the incoming gradients into

    dlogp/dz_v    = onehot(y)_v - p_v
    dentropy/dz_v = -p_v * (z_v - sum_u p_u z_u)        (sum p z = lse - entropy)

then dL/d(h W^T) = dL/dz / temperature, accumulated into grad_hidden (per
chunk) and grad_weight (summed over chunks in fp32, cast back at the end).
Peak extra memory is about two [chunk_size, V] fp32 buffers, plus one fp32
[V, H] accumulator in backward.
"""
from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (exact gradient checks)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    z = (hidden @ weight.t()).to(_compute_dtype(hidden.dtype))
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy):
        num_tokens = hidden.shape[0]
        logp = torch.empty(num_tokens, dtype=_compute_dtype(hidden.dtype), device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
        for s in range(0, num_tokens, chunk_size):
            e = min(s + chunk_size, num_tokens)
            z = _chunk_logits(hidden[s:e], weight, temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s:e] = lse_c
            logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse_c
            if with_entropy:
                p = (z - lse_c[:, None]).exp_()
                ent[s:e] = lse_c - p.mul_(z).sum(-1)
                del p
            del z
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        if with_entropy:
            ctx.save_for_backward(hidden, weight, targets, lse, ent)
        else:
            ctx.save_for_backward(hidden, weight, targets, lse)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets, lse = ctx.saved_tensors[:4]
        ent = ctx.saved_tensors[4] if ctx.with_entropy else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp is None and grad_ent is None:
            return None, None, None, None, None, None
        tau = ctx.temperature
        num_tokens = hidden.shape[0]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # fp32 accumulator: summing many bf16 per-chunk products in bf16 would lose precision.
        grad_w = (torch.zeros(weight.shape, dtype=_compute_dtype(weight.dtype), device=weight.device)
                  if need_w else None)
        for s in range(0, num_tokens, ctx.chunk_size):
            e = min(s + ctx.chunk_size, num_tokens)
            z = _chunk_logits(hidden[s:e], weight, tau)
            lse_c = lse[s:e, None]
            p = (z - lse_c).exp_()
            # dL/dz = g_logp * (onehot - p) - g_ent * p * (z - sum p z), built in place.
            if grad_ent is not None:
                gz = z.sub_(lse_c - ent[s:e, None]).mul_(grad_ent[s:e, None].to(z.dtype))
                if grad_logp is not None:
                    gz.add_(grad_logp[s:e, None].to(z.dtype))
                gz.mul_(p).neg_()
            else:
                gz = p.mul_(grad_logp[s:e, None].to(z.dtype)).neg_()
            del p, z
            if grad_logp is not None:
                gz.scatter_add_(1, targets[s:e, None], grad_logp[s:e, None].to(gz.dtype))
            if tau != 1.0:
                gz.div_(tau)
            gz = gz.to(weight.dtype)
            if need_h:
                grad_h[s:e] = gz @ weight
            if need_w:
                grad_w += gz.t() @ hidden[s:e]
            del gz
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def chunked_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      temperature: float = 1.0, chunk_size: int = 4096, with_entropy: bool = False,
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[t] | position t) [T] fp32 and entropy [T] fp32 (None unless with_entropy).

    (fp64 inputs compute and return fp64.)

    hidden [T, H] final normed hidden states, weight [V, H] the LM head (same
    dtype as hidden), targets [T] int64, temperature divides the logits.
    Differentiable in hidden and weight.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"chunked_log_probs: hidden {tuple(hidden.shape)} and weight "
                         f"{tuple(weight.shape)} must be [T, H] and [V, H]")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"chunked_log_probs: hidden dtype {hidden.dtype} != weight dtype {weight.dtype}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"chunked_log_probs: targets {tuple(targets.shape)} must be [{hidden.shape[0]}]")
    if chunk_size < 1:
        raise ValueError(f"chunked_log_probs: chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"--rollout-temperature: log-probs need a temperature > 0, got {temperature}")
    return _ChunkedLogProbs.apply(hidden, weight, targets.long(), float(temperature), int(chunk_size),
                                  bool(with_entropy))
