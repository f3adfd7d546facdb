"""bench/skinny_linear.py's split-K kernel against torch's matmul (CUDA, or the CPU under TRITON_INTERPRET=1
with fp32): every split count, rows not a multiple of the tile, counters reset for the next call, the
same bits on a second call (deterministic split order)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                                                  reason="needs CUDA (or TRITON_INTERPRET=1)")]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("m", [3, 16, 40])
def test_split_k_matmul_matches_torch(split_k, m):
    from skinny_linear import SkinnyConfig, SkinnyLinear
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    k, n = (512, 128) if INTERPRET else (2048, 1024)
    g = torch.Generator(device=DEV).manual_seed(m * 10 + split_k)
    x = torch.randn(m, k, device=DEV, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) * 0.02).to(dtype)
    lin = SkinnyLinear(SkinnyConfig(block_m=16, block_n=64, block_k=64 if INTERPRET else 128, split_k=split_k,
                                    num_warps=4, num_stages=2 if INTERPRET else 4))
    ref = x.float() @ w.float().T
    y = lin(x, w)
    assert y.dtype == dtype and y.shape == (m, n)
    tol = 1e-4 if INTERPRET else 1e-2            # bf16 output rounding: ~4e-3 relative
    assert ((y.float() - ref).norm() / ref.norm()).item() < tol
    counters = [c for _, c in lin.buffers.values()]
    assert all(int(c.abs().sum()) == 0 for c in counters)          # reset by the last program of each tile
    assert torch.equal(lin(x, w), y)                               # the same bits again


def test_config_refuses_a_shape_it_cannot_tile():
    from skinny_linear import SkinnyConfig, SkinnyLinear
    with pytest.raises(ValueError, match="does not fit M=4 K=100 N=64"):
        SkinnyLinear(SkinnyConfig(split_k=2))(torch.zeros(4, 100, device=DEV), torch.zeros(64, 100, device=DEV))
