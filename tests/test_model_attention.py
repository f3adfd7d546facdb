"""The packed (varlen) attention op of furlong.models.attention on its own: the per-sample
reference and its explicit backward against plain SDPA (and torch.library.opcheck), and the
CUDA flash path against that reference."""
from __future__ import annotations

import pytest
import torch

from furlong.models.attention import packed_attention


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_packed_attention_reference_gradients(kv_heads):
    """The per-sample op (the CPU path, opaque to torch.compile) and its explicit backward: the same
    outputs and q/k/v gradients as autograd through plain SDPA on each sample (K/V expanded), and
    its registration (fake kernel, autograd) passes torch.library.opcheck."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(7)
    lengths = [3, 1, 6, 4]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lengths), h, 8, generator=g, dtype=torch.float64)
               for h in (4, kv_heads, kv_heads))
    grad = torch.randn(sum(lengths), 4, 8, generator=g, dtype=torch.float64)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    def plain(q, k, v):
        rows = []
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            seg = lambda t, n=1: t[s:e].repeat_interleave(n, dim=1).transpose(0, 1)  # noqa: E731
            groups = 4 // kv_heads
            out = F.scaled_dot_product_attention(seg(q), seg(k, groups), seg(v, groups), is_causal=True)
            rows.append(out.transpose(0, 1))
        return torch.cat(rows)

    for ours, ref in zip(run(lambda q, k, v: packed_attention(q, k, v, cu, max(lengths), impl="per_sample")),
                         run(plain)):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(torch.ops.furlong.packed_attention_ref.default, (*leaves, cu, max(lengths), 8 ** -0.5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_heads", [2, 8])
def test_flash_matches_per_sample_bf16(kv_heads):
    """The flash path (GQA in the kernel) against the fp32 per-sample reference: outputs and the
    gradients of q, k and v (K/V gradients are summed over each group inside aten's backward)."""
    from furlong.models.attention import select_packed_impl
    torch.manual_seed(0)
    lengths = [37, 5, 128, 1, 64]
    total, d = sum(lengths), 64
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(total, 8, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(total, 8, d, device="cuda")
    assert select_packed_impl(q) == "flash"
    grads = []
    for dtype, name in ((torch.bfloat16, "flash"), (torch.float32, "per_sample")):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = packed_attention(*leaves, cu, max(lengths), impl=name)
        (out.float() * g).sum().backward()
        grads.append([out.detach().float()] + [t.grad.float() for t in leaves])
    for fast, ref in zip(*grads):
        assert (fast - ref).abs().max().item() < 5e-2 * max(1.0, ref.abs().max().item())
