"""bench/decode_fma_kernel.py's CUDA-core decode attention (an experiment beside the engine's kernel)
against the dequantised references, plain and with cascade groups, fp8 and unquantised K/V, at several
split counts and tile settings (CUDA; or the CPU under TRITON_INTERPRET=1 with small shapes, as
test_kv_fp8_gpu.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from test_kv_fp8_gpu import DEV, DTYPES, SHAPE, fp8_cache, pytestmark, rel_err  # noqa: E402,F401 (pytestmark: gpu)


def _case(cascade, fp8, g):
    from furlong.engine.cascade import PrefixGroups, cascade_members
    rows, hq, hkv, d, page, pages, longest = SHAPE
    keys, values, ks, vs = fp8_cache(pages, hkv, page, d, g)
    if not fp8:
        ks_f = ks[..., None].float()
        keys, values, ks, vs = keys.float() * ks_f, values.float() * vs[..., None].float(), None, None
    prefix = (page + page // 2, 2 * page + 2)
    lens = torch.tensor([0, prefix[0] + 1, prefix[0] + 10, prefix[0] + 3 * page, longest, prefix[1] + 1,
                         prefix[1] + page, 5, prefix[1] + 40][:rows] + [7] * max(0, rows - 9),
                        dtype=torch.int32, device=DEV)
    tables = torch.randint(1, pages, (rows, -(-longest // page)), device=DEV, generator=g, dtype=torch.int32)
    groups = None
    if cascade:
        group_rows = torch.full((rows, cascade_members(hq, hkv)), -1, dtype=torch.int32, device=DEV)
        group_rows[0, :3] = torch.tensor([1, 2, 3])
        group_rows[1, :2] = torch.tensor([8, 5])
        group_prefix = torch.zeros(rows, dtype=torch.int32, device=DEV)
        group_prefix[:2] = torch.tensor(prefix)
        prefix_lens = torch.zeros(rows, dtype=torch.int32, device=DEV)
        prefix_lens[[1, 2, 3]] = prefix[0]
        prefix_lens[[5, 8]] = prefix[1]
        groups = PrefixGroups(prefix_lens, group_rows, group_prefix)
    return keys, values, ks, vs, tables, lens, groups


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("cascade", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_n,acc3", [(16, False), (8, True)])
def test_fma_decode_attention_matches_the_references(dtype, num_splits, cascade, fp8, block_n, acc3):
    from decode_fma_kernel import fma_decode_attention
    from furlong.engine.cascade import cascade_attention_reference
    from furlong.engine.kv_cache import decode_attention_reference
    g = torch.Generator(device=DEV).manual_seed(num_splits + 2 * cascade)
    keys, values, ks, vs, tables, lens, groups = _case(cascade, fp8, g)
    rows, hq, _, d = SHAPE[0], SHAPE[1], SHAPE[2], SHAPE[3]
    q = torch.randn(rows, hq, d, device=DEV, generator=g).to(dtype)
    if not fp8:
        keys, values = keys.to(dtype), values.to(dtype)
    out = fma_decode_attention(q, keys, values, tables, lens, num_splits, block_n=block_n, acc3=acc3,
                               key_scales=ks, value_scales=vs, prefix=groups, group_splits=2 if cascade else 1)
    rk, rv = (keys, values) if fp8 else (keys.double(), values.double())   # fp8: the reference widens them
    if cascade:
        ref = cascade_attention_reference(q.double(), rk, rv, tables, lens, groups, ks, vs)
    else:
        ref = decode_attention_reference(q.double(), rk, rv, tables, lens, ks, vs)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
