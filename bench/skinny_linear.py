"""A split-K Triton matmul for decode's skinny GEMMs, an experiment for bench/decode_gemm_sweep.py (CUDA, or
the CPU under TRITON_INTERPRET=1).

Why: a decode step multiplies B <= 256 rows by every weight once. cuBLAS takes 5.5-8.6 us per layer
projection at any B on an H100 (BENCHMARKS.md), 20-27% of the weight-read floor for the N=1024
projections (o, down), whose few output tiles leave most multiprocessors idle. Splitting K gives every
multiprocessor a slice of the weight: grid (N / BLOCK_N, SPLIT_K, ceil(M / BLOCK_M)); each program
multiplies its K range into an fp32 tile. With SPLIT_K > 1 each writes its partial tile to a workspace
[SPLIT_K, M_pad, N] and bumps the tile's counter; the program that arrives last sums the SPLIT_K
partials in split order (deterministic: the same bits every run, unlike fp32 atomic adds), stores the
bf16 result and resets the counter to 0, so one launch needs no memset and replays in a CUDA graph.

Ordering: a program's partial-tile stores come before its counter bump by a CTA barrier followed by a
gpu-scope acq_rel atomic (release covers what the CTA's threads stored before the barrier); the last
program's acquire makes every other program's partials visible, and it reads them with .cg loads
(L2, not a stale L1 line).

Not in the engine: wired in only if the sweep shows it beating cuBLAS at the decode shapes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K_PER_SPLIT, M_PAD,
                   stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    k0 = pid_k * K_PER_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        ks = k0 + kk + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None], other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + ks[:, None])          # [BLOCK_K, BLOCK_N] of w^T
        acc = tl.dot(a, b, acc)
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        part = ws_ptr + (pid_k * M_PAD + rm[:, None]) * N + rn[None, :]
        tl.store(part, acc)
        tl.debug_barrier()                                   # every thread's partial stored before the bump
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):                          # split order: deterministic
                total += tl.load(ws_ptr + (s * M_PAD + rm[:, None]) * N + rn[None, :], cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class SkinnyConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 4

    def fits(self, m: int, k: int, n: int) -> bool:
        """Whether the kernel's unmasked K and N loads stay in bounds for this shape."""
        return n % self.block_n == 0 and k % (self.block_k * self.split_k) == 0 and self.block_m >= 16


@dataclass
class SkinnyLinear:
    """y = x @ w^T by the split-K kernel; owns the workspace and tile counters (zeroed once, reset by the
    kernel), so a call inside a CUDA graph allocates nothing once a shape has run eagerly."""
    config: SkinnyConfig
    buffers: dict = field(default_factory=dict)      # (device, m_pad, n) -> (workspace, counters)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        c = self.config
        m, k = x.shape
        n = w.shape[0]
        if not c.fits(m, k, n) or x.stride(1) != 1 or w.stride(1) != 1:
            raise ValueError(f"SkinnyLinear: {c} does not fit M={m} K={k} N={n} (or a non-contiguous K)")
        grid_m = triton.cdiv(m, c.block_m)
        m_pad = grid_m * c.block_m
        key = (x.device, m_pad, n)
        if key not in self.buffers:
            self.buffers[key] = (torch.empty(c.split_k * m_pad * n if c.split_k > 1 else 1, device=x.device,
                                             dtype=torch.float32),
                                 torch.zeros(grid_m * (n // c.block_n), device=x.device, dtype=torch.int32))
        ws, cnt = self.buffers[key]
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
        _skinny_kernel[(n // c.block_n, c.split_k, grid_m)](
            x, w, y, ws, cnt, m, n, k // c.split_k, m_pad, x.stride(0), w.stride(0), y.stride(0),
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=c.split_k,
            num_warps=c.num_warps, num_stages=c.num_stages)
        return y


def candidate_configs(m: int, k: int, n: int, num_sms: int) -> list[SkinnyConfig]:
    """A few configs per shape for the sweep: BLOCK_M the batch's power of two (16 to 64), split counts
    that bring the programs near one and two per multiprocessor, 64- and 128-wide N tiles."""
    block_m = min(64, max(16, 1 << (m - 1).bit_length()))
    out = []
    for block_n in (64, 128):
        tiles = (n // block_n) * -(-m // block_m)
        for want in (num_sms, 2 * num_sms):
            split = max(1, min(16, 1 << max(0, (-(-want // tiles) - 1).bit_length())))
            c = SkinnyConfig(block_m, block_n, 128, split, 4, 4)
            while c.split_k > 1 and not c.fits(m, k, n):          # halve the split until K tiles evenly
                c = dataclasses.replace(c, split_k=c.split_k // 2)
            if c.fits(m, k, n) and c not in out:
                out.append(c)
    return out
