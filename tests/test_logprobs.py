"""chunked_log_probs against the naive full-logits computation (values and gradients)."""
import pytest
import torch

from furlong.trainer.logprobs import chunked_log_probs


def naive(hidden, weight, targets, temperature):
    z = (hidden @ weight.t()) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def make(num_tokens, hidden_size=16, vocab=37, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(num_tokens, hidden_size, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (num_tokens,), generator=g)
    return h, w, y


def grads_of(fn, h, w, a, b):
    """Gradients of sum(a*logp) + sum(b*entropy) (b None: no entropy term)."""
    h.grad = w.grad = None
    logp, ent = fn()
    loss = (a * logp).sum() + ((b * ent).sum() if b is not None else 0.0)
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach(), h.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 7, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_matches_naive_fp32(chunk_size, temperature, with_entropy):
    h, w, y = make(10)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(10, generator=g)
    b = torch.randn(10, generator=g) if with_entropy else None
    lp, ent, gh, gw = grads_of(lambda: chunked_log_probs(h, w, y, temperature, chunk_size, with_entropy),
                               h, w, a, b)
    assert lp.dtype == torch.float32
    assert (ent is not None) == with_entropy

    def ref():
        logp, e = naive(h.double(), w.double(), y, temperature)
        return logp, e if with_entropy else None
    rlp, rent, rgh, rgw = grads_of(ref, h, w, a.double(), None if b is None else b.double())
    torch.testing.assert_close(lp, rlp.float(), atol=1e-5, rtol=1e-5)
    if with_entropy:
        torch.testing.assert_close(ent, rent.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, rgh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, rgw, atol=1e-5, rtol=1e-5)


def test_gradcheck_fp64():
    h, w, y = make(9, hidden_size=6, vocab=11, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda h, w: chunked_log_probs(h, w, y, 0.6, 4, True), (h, w))
    assert torch.autograd.gradcheck(lambda h, w: chunked_log_probs(h, w, y, 1.3, 2, False)[0], (h, w))


def test_gradient_through_entropy_only():
    h, w, y = make(5)
    _, ent = chunked_log_probs(h, w, y, 0.9, 2, True)
    ent.sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    naive(h, w, y, 0.9)[1].sum().backward()
    torch.testing.assert_close(gh, h.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, w.grad, atol=1e-5, rtol=1e-5)


def test_empty():
    h, w, y = make(0)
    lp, ent = chunked_log_probs(h, w, y, 0.5, 4, True)
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert h.grad.shape == h.shape
    assert torch.count_nonzero(w.grad) == 0


def test_frozen_weight_and_no_grad():
    h, w, y = make(6)
    w.requires_grad_(False)
    lp, _ = chunked_log_probs(h, w, y)
    lp.sum().backward()
    h2 = h.detach().clone().requires_grad_()
    naive(h2, w, y, 1.0)[0].sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        lp, _ = chunked_log_probs(h, w, y, chunk_size=4)
    assert lp.grad_fn is None


def test_bf16_inputs_return_fp32():
    h, w, y = make(13, dtype=torch.bfloat16)
    lp, ent = chunked_log_probs(h, w, y, 0.8, 5, True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    # Reference: the same bf16 matmul, then fp32 softmax math.
    z = (h.detach() @ w.detach().t()).float()
    rlp, rent = naive(z, torch.eye(z.shape[1]), y, 0.8)
    torch.testing.assert_close(lp, rlp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent, rent, atol=1e-4, rtol=1e-4)
    (lp.sum() + ent.sum()).backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    a, b = naive(hf, wf, y, 0.8)
    (a.sum() + b.sum()).backward()
    torch.testing.assert_close(h.grad.float(), hf.grad, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(w.grad.float(), wf.grad, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("bad", ["dtype", "shape", "targets", "chunk", "temperature"])
def test_bad_input(bad):
    h, w, y = make(4)
    kwargs = {}
    if bad == "dtype":
        w = w.detach().double()
    elif bad == "shape":
        w = w.detach()[:, :3]
    elif bad == "targets":
        y = y[:2]
    elif bad == "chunk":
        kwargs["chunk_size"] = 0
    else:
        kwargs["temperature"] = 0.0
    with pytest.raises(ValueError):
        chunked_log_probs(h, w, y, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_matches_fp32_and_saves_memory():
    torch.manual_seed(0)
    num_tokens, hidden_size, vocab = 8192, 256, 32768
    h = (torch.randn(num_tokens, hidden_size, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden_size, device="cuda") * 0.05).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (num_tokens,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = chunked_log_probs(h, w, y, 0.9, 1024, True)
    (lp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < num_tokens * vocab * 4  # less than one fp32 [T, V] tensor
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    rlp, rent = naive(hf, wf, y, 0.9)
    (rlp.sum() + rent.sum()).backward()
    torch.testing.assert_close(lp, rlp, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ent, rent, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(h.grad.float(), hf.grad, atol=2e-2, rtol=5e-2)
    torch.testing.assert_close(w.grad.float(), wf.grad, atol=2e-2, rtol=5e-2)


def _compiled_matches_eager(device: str, dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(7)
    T, H, V = 37, 16, 50
    h0 = torch.randn(T, H, generator=g).to(device, dtype)
    w0 = (0.5 * torch.randn(V, H, generator=g)).to(device, dtype)
    y = torch.randint(0, V, (T,), generator=g).to(device)
    gl, ge = torch.randn(T, generator=g).to(device), torch.randn(T, generator=g).to(device)
    outs = []
    for compiled in (False, True):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, ent = chunked_log_probs(h, w, y, temperature=0.7, chunk_size=16, with_entropy=True, compiled=compiled)
        ((lp * gl).sum() + (ent * ge).sum()).backward()
        outs.append((lp.detach(), ent.detach(), h.grad.float(), w.grad.float()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_compiled_chunks_match_eager_cpu():
    """The torch.compile'd chunk kernels (the CUDA default) compute the eager function."""
    _compiled_matches_eager("cpu", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_chunks_match_eager_cuda():
    _compiled_matches_eager("cuda", torch.bfloat16, 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logits_give_the_same_gradients(dtype):
    """Keeping the forward's logits (all chunks, the first two, none) changes nothing: backward would
    recompute the very same products. bf16 also runs the fp32 weight-gradient accumulator."""
    h, w, y = make(23, hidden_size=8, vocab=29, dtype=dtype, seed=3)
    a, b = torch.randn(23, generator=torch.Generator().manual_seed(4)), torch.randn(23)
    chunk_bytes = 5 * 29 * h.element_size()
    out = []
    for keep in (0, 2 * chunk_bytes, 2 * chunk_bytes + 1, 10 ** 9):
        out.append(grads_of(lambda: chunked_log_probs(h, w, y, 0.9, 5, True, impl="eager", keep_logits_bytes=keep),
                            h, w, a, b))
    for other in out[1:]:
        for x, ref in zip(other, out[0]):
            torch.testing.assert_close(x, ref, rtol=0, atol=0)
    ref = grads_of(lambda: naive(h.double(), w.double(), y, 0.9), h, w, a, b)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for x, r in zip(out[-1], ref):
        torch.testing.assert_close(x.double(), r.double(), rtol=tol, atol=tol)
