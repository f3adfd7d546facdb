"""The Triton chunk kernels of the log-probs (CUDA) against the eager reference: values and gradients."""
import pytest
import torch

from furlong.trainer.logprobs import chunked_log_probs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_triton_matches_eager(dtype, with_entropy):
    g = torch.Generator(device="cuda").manual_seed(0)
    num_tokens, hidden_size, vocab = 300, 64, 5003          # vocab not a multiple of the kernel's block
    h = (torch.randn(num_tokens, hidden_size, device="cuda", generator=g) * 0.5).to(dtype)
    w = (torch.randn(vocab, hidden_size, device="cuda", generator=g) * 0.5).to(dtype)
    y = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=g)
    gl = torch.randn(num_tokens, device="cuda", generator=g)
    ge = torch.randn(num_tokens, device="cuda", generator=g)
    out = {}
    for impl in ("eager", "triton"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = chunked_log_probs(hh, ww, y, temperature=0.7, chunk_size=128, with_entropy=with_entropy,
                                      impl=impl)
        loss = (logp * gl).sum() + ((ent * ge).sum() if with_entropy else 0)
        loss.backward()
        out[impl] = (logp.detach(), None if ent is None else ent.detach(), hh.grad.float(), ww.grad.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), out["eager"], out["triton"]):
        if a is None:
            assert b is None
            continue
        assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), (name, (a.float() - b.float()).abs().max())


@cuda
def test_triton_logp_only_gradient():
    """Entropy computed but carrying no gradient (the trainer's usual case): grad_ent is None."""
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(70, 32, device="cuda", generator=g)
    w = torch.randn(1000, 32, device="cuda", generator=g)
    y = torch.randint(0, 1000, (70,), device="cuda", generator=g)
    grads = []
    for impl in ("eager", "triton"):
        hh = h.clone().requires_grad_()
        logp, ent = chunked_log_probs(hh, w, y, chunk_size=32, with_entropy=True, impl=impl)
        logp.sum().backward()
        grads.append(hh.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-4, rtol=1e-4)


@cuda
def test_triton_kept_logits_match_recomputed():
    """The trainer's CUDA path: bf16, Triton kernels, logits kept from forward (partly: the budget
    holds two chunks of three) and the weight gradient accumulated by cuBLAS into fp32 (addmm's
    out_dtype): bitwise the gradients of recomputing every chunk, and close to the eager fp32
    reference. A second backward through kept logits (which the grad kernel overwrote) must raise."""
    g = torch.Generator(device="cuda").manual_seed(2)
    num_tokens, hidden_size, vocab = 300, 64, 5003
    h = (torch.randn(num_tokens, hidden_size, device="cuda", generator=g) * 0.5).bfloat16()
    w = (torch.randn(vocab, hidden_size, device="cuda", generator=g) * 0.5).bfloat16()
    y = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=g)
    gl = torch.randn(num_tokens, device="cuda", generator=g)
    out = []
    for keep in (0, 2 * 128 * vocab * 2):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = chunked_log_probs(hh, ww, y, 0.7, 128, True, impl="triton", keep_logits_bytes=keep)
        (logp * gl).sum().backward(retain_graph=True)
        out.append((logp.detach(), ent.detach(), hh.grad.clone(), ww.grad.clone()))
        if keep:
            with pytest.raises(RuntimeError):
                (logp * gl).sum().backward()
    for a, b in zip(*out):
        assert torch.equal(a, b)
    hf, wf = h.float().requires_grad_(), w.float().requires_grad_()
    logp, _ = chunked_log_probs(hf, wf, y, 0.7, 128, True, impl="eager")
    (logp * gl).sum().backward()
    assert torch.allclose(out[1][3].float(), wf.grad, atol=2e-2, rtol=5e-2)
    assert torch.allclose(out[1][2].float(), hf.grad, atol=2e-2, rtol=5e-2)
