"""The engine's Triton sampler (CUDA only; imported lazily).

sample_tokens  one pass over a row's logits: the online log-sum-exp of the
    scaled logits (for the chosen token's log-prob) and the argmax of the
    exponential race with counter-based noise, exactly as sampling.py's
    reference (same hash, same threshold rule, first index on ties). Each row's
    vocabulary is cut into chunks run by separate programs (a small batch would
    otherwise leave most multiprocessors idle), merged by a second kernel.
Fixed-shape and sync-free, so it is captured in the decode CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SAMPLE_CHUNKS = 32   # vocabulary chunks per row of the sampler


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _sample_chunk_kernel(LOGITS, s_lb, INV_T, GREEDY, THR, SEED, POS, P_MX, P_SE, P_BEST, P_IDX, V, CHUNK,
                         num_chunks, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    inv_t = tl.load(INV_T + b)
    greedy = tl.load(GREEDY + b) != 0
    thr = tl.load(THR + b)
    seed = tl.load(SEED + b).to(tl.uint32)
    pos = tl.load(POS + b).to(tl.uint32)
    key = _mix32(seed ^ _mix32(pos + 0x632BE5AB))
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    mx = tl.full([], float("-inf"), tl.float32)
    se = tl.full([], 0.0, tl.float32)
    offs = tl.arange(0, BLOCK)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK):
        v = start + offs
        vm = v < hi
        x = tl.load(LOGITS + b * s_lb + v, mask=vm, other=float("-inf")).to(tl.float32)
        sc = x * inv_t
        tile_max = tl.max(sc, 0)
        new_mx = tl.maximum(mx, tile_max)
        safe_mx = tl.where(new_mx == float("-inf"), 0.0, new_mx)
        se = se * tl.exp(mx - safe_mx) + tl.sum(tl.where(vm, tl.exp(sc - safe_mx), 0.0), 0)
        mx = new_mx
        h = _mix32(key ^ (v.to(tl.uint32) * 0x9E3779B9))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(greedy, x, sc - tl.log(-tl.log(u)))      # log p - log E, E = -log u
        score = tl.where(vm & (sc >= thr), score, float("-inf"))
        tile_best, tile_idx = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
        better = tile_best > best
        best_idx = tl.where(better, start + tile_idx, best_idx)
        best = tl.where(better, tile_best, best)
    out = b * num_chunks + c
    tl.store(P_MX + out, mx)
    tl.store(P_SE + out, se)
    tl.store(P_BEST + out, best)
    tl.store(P_IDX + out, best_idx)


@triton.jit
def _sample_combine_kernel(LOGITS, s_lb, INV_T, P_MX, P_SE, P_BEST, P_IDX, TOK, LP, num_chunks,
                           MAX_CHUNKS: tl.constexpr):
    b = tl.program_id(0)
    c = tl.arange(0, MAX_CHUNKS)
    cm = c < num_chunks
    mx_c = tl.load(P_MX + b * num_chunks + c, mask=cm, other=float("-inf"))
    se_c = tl.load(P_SE + b * num_chunks + c, mask=cm, other=0.0)
    mx = tl.max(mx_c, 0)
    se = tl.sum(tl.where(se_c > 0, se_c * tl.exp(mx_c - mx), 0.0), 0)
    best_c = tl.load(P_BEST + b * num_chunks + c, mask=cm, other=float("-inf"))
    _, chunk = tl.max(best_c, 0, return_indices=True, return_indices_tie_break_left=True)   # first on ties
    best_idx = tl.load(P_IDX + b * num_chunks + chunk)
    chosen = tl.load(LOGITS + b * s_lb + best_idx).to(tl.float32) * tl.load(INV_T + b)
    tl.store(TOK + b, best_idx.to(tl.int64))
    tl.store(LP + b, chosen - (mx + tl.log(se)))


def sample_chunks(num_rows: int, vocab: int, num_sms: int, block: int = 2048) -> int:
    """Vocabulary chunks per row: ~8 programs per multiprocessor (one row alone leaves the GPU idle),
    a power of two, each chunk at least one block."""
    want = -(-8 * num_sms // max(num_rows, 1))
    return max(1, min(MAX_SAMPLE_CHUNKS, 1 << (want - 1).bit_length(), 1 << ((-(-vocab // block)).bit_length() - 1)))


def sample_tokens(logits: torch.Tensor, inv_temperature: torch.Tensor, greedy: torch.Tensor,
                  thresholds: torch.Tensor, seed32: torch.Tensor, positions: torch.Tensor,
                  num_chunks: int | None = None, block: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype, last dim contiguous) -> (tokens [B] int64, log_probs [B] float32).
    thresholds: [B] float32, -inf where nothing is cut. num_chunks: vocabulary chunks per row (a power
    of two; default: sample_chunks)."""
    num_rows, vocab = logits.shape
    num_sms = torch.cuda.get_device_properties(logits.device).multi_processor_count if logits.is_cuda else 1
    chunks = sample_chunks(num_rows, vocab, num_sms, block) if num_chunks is None else num_chunks
    if not 1 <= chunks <= MAX_SAMPLE_CHUNKS:
        raise ValueError(f"sample_tokens: num_chunks must be in [1, {MAX_SAMPLE_CHUNKS}], got {chunks}")
    chunk = -(-vocab // chunks // block) * block                  # whole blocks per chunk
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    log_probs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    part = torch.empty(3, num_rows, chunks, dtype=torch.float32, device=logits.device)   # max, sum-exp, best score
    part_idx = torch.empty(num_rows, chunks, dtype=torch.int32, device=logits.device)
    _sample_chunk_kernel[(num_rows, chunks)](logits, logits.stride(0), inv_temperature, greedy, thresholds, seed32,
                                             positions, part[0], part[1], part[2], part_idx, vocab, chunk,
                                             chunks, BLOCK=block, num_warps=8)
    # one compiled combine for every chunk count (MAX_CHUNKS lanes, masked): fewer first-use compiles
    _sample_combine_kernel[(num_rows,)](logits, logits.stride(0), inv_temperature, part[0], part[1], part[2],
                                        part_idx, tokens, log_probs, chunks, MAX_CHUNKS=MAX_SAMPLE_CHUNKS,
                                        num_warps=1)
    return tokens, log_probs
