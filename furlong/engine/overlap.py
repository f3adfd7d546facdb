"""Two halves of a decode step's rows on two CUDA streams (ModelRunner.overlap_min_rows; off by default).

Why: a decode step's non-attention kernels are latency-bound. Each of a layer's four matmuls takes
5.7-8.6 us on an H100 whatever the batch (16 to 256 rows), 20-52% of its weight-read floor, and the
norm, prologue and combine kernels are a few microseconds each (BENCHMARKS.md): about 1.2-1.3 ms a
step over the long rollout, ~10 s of its 58 on an H100 (issue 21). Neither cuBLASLt (within 3% of
cuBLAS) nor inductor's autotuned Triton templates (slower at every batch) do better. The rows of a decode step are independent, so splitting them into two
halves, each a whole forward on its own stream, gives the GPU two chains of kernels to run side by
side. The expectation (not yet measured): two latency-bound matmuls side by side take about as long
as one, and a half's attention (bandwidth-bound) streams while the other half's small kernels run. The price: each half reads every layer weight
(1.2 GB at Qwen3-0.6B; the halves run close together, so much of the second read may hit L2) and
twice the launches. Each half's attention gets the split count of a batch its size (ModelRunner), so
either launch alone fills the GPU; when both run at once their programs queue. The LM head and the
sampler run once, on the joined hidden states.

Cascade windows split too: each half plans its own groups (ModelRunner._groups), its rows and group
slots indexed within it, so a request's samples that the split separates read their prompt once per
side rather than once.

Not measured on a GPU yet: `bench/rollout_time_split.py --overlap-rows 0,16` runs the long rollout both
ways on one engine, `bench/profile_decode.py --overlap-rows` one graphed step (bench/pending_device.sh
overlap).

On the CPU (and on a GPU without a side stream given) the halves run one after the other, which is
how the CPU tests check that the halves compute what the whole batch does.
"""
from __future__ import annotations

from typing import Callable

import torch


def run_halves(first: Callable[[], torch.Tensor], second: Callable[[], torch.Tensor],
               side: torch.cuda.Stream | None) -> torch.Tensor:
    """torch.cat([first(), second()]), `second` on the `side` stream when given (CUDA; graph-capture safe:
    the side stream forks from and joins back to the current stream with events, as a captured graph
    requires, and its output is recorded on the current stream before the current stream uses it)."""
    if side is None:
        return torch.cat([first(), second()])
    main = torch.cuda.current_stream()
    side.wait_stream(main)               # the side's reads (inputs, cache, weights) after what came before
    with torch.cuda.stream(side):
        b = second()
    a = first()
    main.wait_stream(side)               # the join: the LM head reads both halves
    b.record_stream(main)                # b's memory is freed on the main stream's schedule, not the side's
    return torch.cat([a, b])
