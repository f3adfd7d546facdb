"""bench/decode_packed_kernel.py (an experiment, not the engine's) against the dequantised reference:
all KV heads of a row in one program must give what the per-head kernel gives (CUDA; or the CPU under
TRITON_INTERPRET=1 with a smaller head_dim)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_kv_fp8_gpu import DEV, DTYPES, INTERPRET, fp8_cache, pytestmark, rel_err  # noqa: E402,F401 (pytestmark: the same marks)

# (rows, Hq, Hkv, D, page, pages, longest context): Hq >= 16 (the dot's rows are the query heads)
SHAPE = (6, 16, 8, 16, 16, 40, 150) if INTERPRET else (13, 16, 8, 128, 64, 400, 2000)


def packed_module():
    path = Path(__file__).resolve().parents[1] / "bench" / "decode_packed_kernel.py"
    spec = importlib.util.spec_from_file_location("decode_packed_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (3, 16), (8, 16), (2, 32)])
def test_packed_kernel_matches_dequantised_reference(dtype, num_splits, block_n):
    from furlong.engine.kv_cache import decode_attention_reference
    rows, hq, hkv, d, page, pages, longest = SHAPE
    if page % block_n:
        pytest.skip("block_n must divide the page")
    g = torch.Generator(device=DEV).manual_seed(num_splits)
    keys, values, ks, vs = fp8_cache(pages, hkv, page, d, g)          # every slot written, V dim-major
    lens = torch.tensor([0, 1, page - 1, page + 1, longest // 2, longest] + [7] * max(0, rows - 6),
                        dtype=torch.int32, device=DEV)[:rows]
    width = -(-longest // page)
    tables = torch.randint(1, pages, (rows, width), device=DEV, generator=g, dtype=torch.int32)
    q = torch.randn(rows, hq, d, device=DEV, generator=g).to(dtype)
    out = packed_module().packed_decode_attention(q, keys, values, tables, lens, num_splits, ks, vs, block_n=block_n)
    ref = decode_attention_reference(q.double(), keys, values, tables, lens, ks, vs)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_packed_kernel_refuses_token_major_values():
    rows, hq, hkv, d, page, pages, _ = SHAPE
    g = torch.Generator(device=DEV).manual_seed(0)
    keys, values, ks, vs = fp8_cache(pages, hkv, page, d, g, v_dim_major=False)
    q = torch.zeros(1, hq, d, device=DEV)
    with pytest.raises(ValueError, match="dim-major"):
        packed_module().packed_decode_attention(q, keys, values, torch.ones(1, 1, dtype=torch.int32, device=DEV),
                                                torch.ones(1, dtype=torch.int32, device=DEV), 1, ks, vs)
