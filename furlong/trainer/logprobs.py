"""Token log-probs and entropy from final hidden states, in chunks (docs/design.md §5).

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

Two savings, both exact (the same numbers as the plain version):
  kept logits: forward may keep its chunks' raw logits (model dtype, bf16 on GPU) for backward,
    up to `keep_logits_bytes`, instead of recomputing h W^T there: one of the four LM-head
    GEMMs per chunk, ~5% of the seed train step (BENCHMARKS.md). The recomputed product is bitwise the
    same tensor. `keep_logits_budget` sets the budget from the device's memory.
  fused accumulation: the weight gradient of each chunk is added by the GEMM itself (beta = 1;
    bf16 inputs into the fp32 accumulator on CUDA) rather than by a separate fp32 add over the
    [V, H] accumulator per chunk.
"""
from __future__ import annotations

import functools

import torch

CHUNK_TOKENS = 4096   # positions per chunk: two fp32 [CHUNK_TOKENS, V] buffers are the peak extra memory


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (exact gradient checks)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_stats(zb: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """Per-token logsumexp, target log-prob and entropy of one chunk's raw logits zb [C, V]."""
    z = zb.to(_compute_dtype(zb.dtype)) / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse
    ent = lse - (torch.exp(z - lse[:, None]) * z).sum(-1) if with_entropy else None
    return lse, logp, ent


def _chunk_grad(zb: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor | None,
                grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None, temperature: float,
                out_dtype: torch.dtype) -> torch.Tensor:
    """dL/d(h W^T) for one chunk [C, V], from the incoming per-token gradients."""
    z = zb.to(_compute_dtype(zb.dtype)) / temperature
    p = torch.exp(z - lse[:, None])
    gz = torch.zeros_like(z)
    if grad_ent is not None:   # sum_u p_u z_u = lse - entropy
        gz = gz - p * (z - (lse - ent)[:, None]) * grad_ent[:, None].to(z.dtype)
    if grad_logp is not None:
        g = grad_logp[:, None].to(z.dtype)
        gz = (gz - p * g).scatter_add(1, targets[:, None], g)
    return (gz / temperature).to(out_dtype)


@functools.lru_cache(maxsize=None)
def _kernels(impl: str):
    """(stats, grad) chunk functions of `impl` (see select_impl)."""
    if impl == "eager":
        return _chunk_stats, _chunk_grad
    if impl == "compiled":
        return (torch.compile(_chunk_stats, dynamic=True), torch.compile(_chunk_grad, dynamic=True))
    if impl == "triton":
        from furlong.trainer import logprob_kernels
        return logprob_kernels.chunk_stats, logprob_kernels.chunk_grad
    raise ValueError(f"chunked_log_probs: unknown impl {impl!r} (eager, compiled, triton)")


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_impl(hidden: torch.Tensor, compiled: bool | None) -> str:
    """The one place the chunk kernels are chosen: Triton on CUDA (one pass per chunk and
    direction), else torch.compile'd when `compiled` (default: on CUDA), else eager. fp64
    (exact gradient checks) is always eager."""
    if hidden.dtype == torch.float64:
        return "eager"
    if hidden.is_cuda and _has_triton():
        return "triton"
    return "compiled" if (hidden.is_cuda if compiled is None else compiled) else "eager"


def keep_logits_budget(device: torch.device) -> int:
    """Bytes of forward logits chunked_log_probs may keep for backward on `device`: a tenth of a
    GPU's memory (15 GB on an H200: the seed step's micro-batches, ~23k response positions each, keep
    all of theirs, ~7 GB; its peak rose 5.2 GiB, BENCHMARKS.md), 0 elsewhere (CPU runs are small; recomputing costs them nothing that matters)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).total_memory // 10


def _accumulate_weight_grad(grad_w: torch.Tensor, gz: torch.Tensor, h: torch.Tensor) -> None:
    """grad_w += gz^T @ h inside the GEMM (beta = 1). grad_w may be fp32 for bf16 gz/h: on CUDA
    cuBLAS then reads bf16 and accumulates into fp32 (addmm's out_dtype); elsewhere, a product
    and an add."""
    if grad_w.dtype == gz.dtype:
        grad_w.addmm_(gz.t(), h)
    elif gz.is_cuda:
        torch.addmm(grad_w, gz.t(), h, out_dtype=grad_w.dtype, out=grad_w)
    else:
        grad_w += (gz.t() @ h).to(grad_w.dtype)


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, impl, keep_logits_bytes):
        stats, _ = _kernels(impl)
        num_tokens = hidden.shape[0]
        logp = torch.empty(num_tokens, dtype=_compute_dtype(hidden.dtype), device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
        kept: list[torch.Tensor] = []   # the first chunks' raw logits [C, V], while they fit the budget
        room = keep_logits_bytes
        for i, s in enumerate(range(0, num_tokens, chunk_size)):
            e = min(s + chunk_size, num_tokens)
            zb = hidden[s:e] @ weight.t()
            lse[s:e], logp[s:e], ent_c = stats(zb, targets[s:e], temperature, with_entropy)
            if with_entropy:
                ent[s:e] = ent_c
            nbytes = zb.numel() * zb.element_size()
            if len(kept) == i and nbytes <= room:   # a prefix: backward finds chunk i at kept[i]
                kept.append(zb)
                room -= nbytes
        ctx.temperature, ctx.chunk_size, ctx.with_entropy, ctx.impl = temperature, chunk_size, with_entropy, impl
        ctx.num_kept = len(kept)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, targets, lse, *([ent] if with_entropy else []), *kept)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        saved = ctx.saved_tensors
        hidden, weight, targets, lse = saved[:4]
        ent = saved[4] if ctx.with_entropy else None
        kept = saved[len(saved) - ctx.num_kept:] if ctx.num_kept else ()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp is None and grad_ent is None:
            return (None,) * 8
        _, grad_fn = _kernels(ctx.impl)
        num_tokens = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None   # every row written below
        # fp32 accumulator: summing many bf16 per-chunk products in bf16 would lose precision.
        grad_w = (torch.zeros(weight.shape, dtype=_compute_dtype(weight.dtype), device=weight.device)
                  if need_w else None)
        for i, s in enumerate(range(0, num_tokens, ctx.chunk_size)):
            e = min(s + ctx.chunk_size, num_tokens)
            # a kept chunk is overwritten by the Triton grad kernel: a second backward through this
            # graph fails autograd's saved-tensor version check instead of reading gradients
            zb = kept[i] if i < len(kept) else hidden[s:e] @ weight.t()
            gz = grad_fn(zb, targets[s:e], lse[s:e], None if ent is None else ent[s:e],
                         None if grad_logp is None else grad_logp[s:e],
                         None if grad_ent is None else grad_ent[s:e], ctx.temperature, weight.dtype)
            del zb
            if need_h:
                torch.mm(gz, weight, out=grad_h[s:e])
            if need_w:
                _accumulate_weight_grad(grad_w, gz, hidden[s:e])
            del gz
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None


def chunked_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      temperature: float = 1.0, chunk_size: int = CHUNK_TOKENS, with_entropy: bool = False,
                      compiled: bool | None = None, impl: str | None = None, keep_logits_bytes: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[t] | position t) [T] fp32 and entropy [T] fp32 (None unless with_entropy).

    (fp64 inputs compute and return fp64.)

    hidden [T, H] final normed hidden states, weight [V, H] the LM head (same
    dtype as hidden), targets [T] int64, temperature divides the logits.
    Differentiable in hidden and weight. The chunk kernels are picked by `select_impl` (Triton on
    CUDA; compiled: torch.compile off CUDA when True); `impl` forces "eager", "compiled" or
    "triton" (tests). All compute the same function. keep_logits_bytes: how many bytes of the
    forward's logits backward may reuse instead of recomputing (module docstring; 0: none).
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
    impl = impl or select_impl(hidden, compiled)
    return _ChunkedLogProbs.apply(hidden, weight, targets.long(), float(temperature), int(chunk_size),
                                  bool(with_entropy), impl, int(keep_logits_bytes))
