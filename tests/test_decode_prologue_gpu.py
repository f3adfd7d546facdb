"""store_kernels.decode_prologue (CUDA; or the CPU under TRITON_INTERPRET=1 with NumPy < 2.4, smaller
shapes, fp32) against what it replaces: forward.pre_attention (eager) then store_kv.

q must equal pre_attention's within a rounding or two of the model dtype; the cache must hold what
store_kv stores from pre_attention's k and v: V bit for bit (it is not recomputed), K within a rounding
(bf16 caches) or, fp8, within one e4m3 step of the row's largest element and equal to 8 ulp for 97% of
the elements (k rows a rounding apart get scales a rounding apart); in both V layouts, with and without
the q/k norms (Qwen3 has them, Llama and Qwen2 do not), and nothing outside the rows' slots written. On
CUDA the engine with the prologue fused generates the same greedy tokens as with it off."""
from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                                                  reason="needs CUDA (or TRITON_INTERPRET=1)")]
# (rows, Hq, Hkv, D, page, pages): Qwen3-0.6B's heads on CUDA, small under the interpreter
SHAPE = (5, 4, 2, 32, 8, 6) if INTERPRET else (37, 16, 8, 128, 64, 40)
DTYPES = [torch.float32] if INTERPRET else [torch.bfloat16, torch.float32]


def make_inputs(dtype, norm, g):
    from furlong.models.rope import rope_cos_sin
    rows, hq, hkv, d, page, pages = SHAPE
    hidden = 64
    x = torch.randn(rows, hidden, device=DEV, generator=g).to(dtype)
    w = dict(ln_w=(1 + 0.1 * torch.randn(hidden, device=DEV, generator=g)).to(dtype),
             qkv_w=(torch.randn((hq + 2 * hkv) * d, hidden, device=DEV, generator=g) / 8).to(dtype),
             qn_w=(1 + torch.rand(d, device=DEV, generator=g) * 4).to(dtype) if norm else None,
             kn_w=(1 + torch.rand(d, device=DEV, generator=g) * 4).to(dtype) if norm else None)
    positions = torch.randint(0, 4000, (rows,), device=DEV, generator=g)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    cos, sin = rope_cos_sin(positions, inv_freq)
    slots = torch.randperm((pages - 1) * page, device=DEV, generator=g)[:rows] + page     # distinct, past page 0
    return x, w, cos, sin, slots // page, slots % page


def cache_views(fp8, v_dim_major, dtype):
    from furlong.engine.kv_cache import KVLayout
    from furlong.engine.kv_fp8 import FP8
    rows, hq, hkv, d, page, pages = SHAPE
    lay = KVLayout(2, hkv, page, d, FP8 if fp8 else dtype, scaled=fp8)
    (k, ks), (v, vs) = (lay.views(torch.zeros(pages * lay.page_bytes, dtype=torch.uint8, device=DEV), pages,
                                  values=i == 1 and v_dim_major) for i in range(2))
    one = lambda t: None if t is None else t[:, 1]  # noqa: E731  layer 1 of 2
    return one(k), one(v), one(ks), one(vs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8,norm", [(False, True), (True, True), (True, False), (False, False)])
def test_prologue_matches_pre_attention_then_store(dtype, fp8, norm):
    from furlong.engine.forward import pre_attention, rms_norm
    from furlong.engine.store_kernels import decode_prologue, store_kv
    import torch.nn.functional as F
    g = torch.Generator(device=DEV).manual_seed(11 + 2 * fp8 + norm)
    rows, hq, hkv, d, page, pages = SHAPE
    x, w, cos, sin, pg, off = make_inputs(dtype, norm, g)
    q_ref, k_ref, v_ref = pre_attention(x, w["ln_w"], w["qkv_w"], None, w["qn_w"], w["kn_w"], cos, sin, 1e-6, hq, hkv, d)
    qkv = F.linear(rms_norm(x, w["ln_w"], 1e-6), w["qkv_w"])
    for v_dim_major in ([True, False] if fp8 else [False]):
        ref = cache_views(fp8, v_dim_major, dtype)
        got = cache_views(fp8, v_dim_major, dtype)
        store_kv(ref[0], ref[1], pg, off, k_ref, v_ref, ref[2], ref[3])
        q = decode_prologue(qkv, w["qn_w"], w["kn_w"], cos, sin, 1e-6, got[0], got[1], pg, off, got[2], got[3])
        ulp = torch.finfo(dtype).eps
        assert q.shape == q_ref.shape and q.dtype == q_ref.dtype
        # one rounding of the model dtype (the kernel's rsqrt and sums differ from torch's in the last bits)
        assert ((q.float() - q_ref.float()).abs() <= 2 * ulp * q_ref.float().abs() + 1e-6).float().mean() > 0.999
        # absolutely: RoPE's difference of products cancels, so an element's error is relative to its row's
        # magnitude (fp32 on an H100 failed 4 ulp relative to the element)
        assert ((q.float() - q_ref.float()).abs() <= 8 * ulp * q_ref.float().abs().amax(-1, keepdim=True)).all()
        kr, vr = ref[0][pg, :, off], ref[1][pg, :, off]                  # [rows, Hkv, D]
        kg, vg = got[0][pg, :, off], got[1][pg, :, off]
        if fp8:
            from furlong.engine.kv_fp8 import dequantize
            kr, kg = dequantize(kr, ref[2][pg, :, off], torch.float32), dequantize(kg, got[2][pg, :, off], torch.float32)
            vr, vg = dequantize(vr, ref[3][pg, :, off], torch.float32), dequantize(vg, got[3][pg, :, off], torch.float32)
            assert torch.equal(vr, vg)                                  # v is not recomputed: bit for bit
            # k rows one rounding apart have scales a rounding apart (every element then differs in its
            # last bits) and may put an element on the neighbouring e4m3 step (2^-3 of the row's largest)
            assert ((kr - kg).abs() <= 2 ** -3 * kr.abs().amax(-1, keepdim=True)).all()
            assert ((kr - kg).abs() <= 8 * ulp * kr.abs()).float().mean() > 0.97
        else:
            assert torch.equal(vr, vg)
            assert torch.allclose(kr.float(), kg.float(), rtol=4 * ulp, atol=4 * ulp)
        # nothing but the rows' slots written
        written = torch.zeros(pages, page, dtype=torch.bool, device=DEV)
        written[pg, off] = True
        for t in got[:2]:
            assert (t.float().transpose(1, 2)[~written] == 0).all()        # [P, page, Hkv, D] at the slots


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine's CUDA graphs need CUDA")
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
@torch.inference_mode()
def test_engine_greedy_tokens_with_the_prologue_fused(kv_dtype):
    """The same requests, greedy, with ModelRunner.fuse_prologue on and off (fp32 weights: the two paths
    differ in the last bits, far below the peaky model's argmax margins)."""
    from test_engine_gpu import NullTok, small_model
    from furlong.engine import Engine, EngineConfig, Request, SamplingParams
    model = small_model(torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (5, 70, 33, 128, 1, 64)]
    tokens = {}
    for fused in (False, True):
        eng = Engine(model, NullTok(), [], EngineConfig(max_model_len=300, max_num_seqs=8, decode_window=8,
                                                        kv_dtype=kv_dtype))
        eng.runner.fuse_prologue = fused
        reqs = [Request(i, p, SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True), n=1 + i % 2)
                for i, p in enumerate(prompts)]
        tokens[fused] = [[c.token_ids for c in comps] for comps in eng.generate(reqs)]
        assert eng.runner.graphs
        eng.release()
    assert tokens[True] == tokens[False]
