"""How many ways the decode attention kernel splits each row's KV (ModelRunner's choice per decode window).

The kernel (kernels.py) runs one program per (row, KV head, split); a multiprocessor holds as many
at once as their registers allow. Two rules:

program_splits (the engine's): a power of two giving ~4 programs per multiprocessor, so that small
    batches still occupy the GPU.
wave_splits (a model, measured; selectable): a step's programs, all about equally long (a rollout's
    rows start together and grow together), run in waves of `slots` = multiprocessors x resident
    programs, and a step costs about
        waves x per-program tiles = ceil(rows x KV heads x S / slots) x (ceil(tiles / S) + overhead)
    in tile-times (tiles: the longest row's KV tiles; overhead: a program's fixed cost, its query load
    and output store, with S > 1 the combine kernel too); it picks the S in SPLIT_COUNTS minimising
    that (the smaller S on ties). Example, 140 rows of 4,096 tokens on 1,056 fp8 slots: S=1 runs 1,120
    programs in two waves, the second 6% full (cost 130); S=8 runs nine fuller ones (cost 81).

Measured on an H100 (BENCHMARKS.md): per layer, fp8 at 4,096 tokens, the wave rule's count is faster
than the program rule's at 100-200 rows (B=140: 0.417 against 0.522 ms, the case above; B=200: 0.583
against 0.631) and within 2% at 48 and 64, but the model misses some (B=256: it keeps S=1, 0.786 ms,
where S=2 takes 0.722), and half-filled multiprocessors read nearly as fast as full ones (B=64: 0.194
ms at S=1 against 0.187 at S=2), so the kernel is not as latency-bound as the model assumes. Over the
long rollout (fp8, forced lengths up to 8,192) the two rules tie: 62.9 s (graph captures left out)
against 62.7 s, and the wave rule captures ~30 more graphs as contexts grow. So the engine keeps
`program_splits` (ModelRunner.split_rule = "programs"); "waves" stays for the benches
(bench/rollout_time_split.py --split-rule).

Resident programs per multiprocessor come from the kernels' register use as Triton 3.6 compiles them
for sm_90 (bench/kernel_sass.py): the padded fp8 kernel at 1 warp 255 registers (8 warps of
256-register allocations fill a 64K register file: 8), the transposed one (kernels_transposed.py, the
engine's fp8 default) 205 (9) and in a cascade launch's row programs 207 (9), fp8 at 2 warps (cascade,
padded) 202 (4), bf16 at 4 warps 115 (4); shared memory (20-39 KB a program) is not the limit. A GPU
test checks these against the compiled kernels.
"""
from __future__ import annotations

import math

SPLIT_COUNTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)   # a short list: every count a window uses is a CUDA graph
OVERHEAD_TILES = 1.0                               # a program's fixed cost, in KV-tile times (not measured)


def programs_per_sm(n_regs: int, num_warps: int, shared_bytes: int, smem_per_sm: int = 233472) -> int:
    """Programs of a compiled kernel one sm_90 multiprocessor holds: registers allocated per warp in
    units of 256 from a 64K file, shared memory (228 KB, 1 KB reserved per block), at most 32 blocks
    and 64 warps."""
    by_regs = 65536 // (-(-n_regs * 32 // 256) * 256) // num_warps
    return min(by_regs, smem_per_sm // (shared_bytes + 1024), 32, 64 // num_warps)


def resident_programs(fp8: bool, cascade: bool, transposed: bool) -> int:
    """A launch's row programs one sm_90 multiprocessor holds at once, as the engine launches them
    (kernels.paged_decode_attention's default warps: fp8 1, or 2 with cascade groups; bf16 4);
    `transposed`: the row programs run kernels_transposed.py's kernel (kv_cache.rows_transposed), at 1
    warp with or without cascade groups (those launch the group programs apart)."""
    if not fp8:
        return 4
    return 9 if transposed else 4 if cascade else 8


def program_splits(rows: int, num_kv_heads: int, num_sms: int, cap: int = 16) -> int:
    """The engine's rule: a power of two in [1, cap] giving ~4 programs per multiprocessor."""
    want = -(-4 * num_sms // (max(1, rows) * num_kv_heads))
    return max(1, min(cap, 1 << (want - 1).bit_length()))


def wave_cost(rows: int, tiles: int, splits: int, num_kv_heads: int, slots: int) -> float:
    """A step's attention time in KV-tile times under the wave model (module docstring)."""
    return math.ceil(rows * num_kv_heads * splits / slots) * (math.ceil(tiles / splits) + OVERHEAD_TILES)


def wave_splits(rows: int, longest: int, block_n: int, num_kv_heads: int, slots: int) -> int:
    """Splits for `rows` rows whose longest context is `longest` tokens (module docstring)."""
    tiles = max(1, -(-longest // block_n))
    return min((s for s in SPLIT_COUNTS if s <= tiles),
               key=lambda s: (wave_cost(max(1, rows), tiles, s, num_kv_heads, slots), s))
