"""GPU checks of the engine (skipped without CUDA).

The Triton kernels against the exact references, the whole engine against a no-cache argmax
loop with CUDA graphs on, graphs across cache releases, weight sync, and the engine-vs-trainer
log-prob gap in bf16."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, model_type="qwen3")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_paged_decode_attention_matches_reference(dtype, num_splits):
    from furlong.engine.kernels import paged_decode_attention
    from furlong.engine.kv_cache import decode_attention_reference
    g = torch.Generator(device="cuda").manual_seed(num_splits)
    rows, hq, hkv, d, page, pages = 13, 16, 8, 128, 64, 200
    keys = torch.randn(pages, hkv, page, d, device="cuda", generator=g).to(dtype)
    values = torch.randn(pages, hkv, page, d, device="cuda", generator=g).to(dtype)
    lens = torch.tensor([0, 1, 5, 63, 64, 65, 130, 700, 1024, 3, 200, 511, 2000], dtype=torch.int32, device="cuda")
    perm = torch.randperm(pages - 1, device="cuda", generator=g) + 1
    tables = perm[:rows * 15].view(rows, 15).to(torch.int32)
    tables = torch.cat([tables, torch.zeros(rows, 17, dtype=torch.int32, device="cuda")], 1)
    tables[-1, :32] = (perm[:32]).to(torch.int32)   # the 2000-token row needs 32 pages (shares some: fine)
    q = torch.randn(rows, hq, d, device="cuda", generator=g).to(dtype)
    out = paged_decode_attention(q, keys, values, tables, lens, num_splits)
    ref = decode_attention_reference(q.double(), keys.double(), values.double(), tables, lens)
    assert torch.isfinite(out).all()
    assert out[0].abs().max() == 0                     # context 0: zeros
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits,group_splits", [(1, 1), (3, 4), (8, 2), (1, 6)])
def test_cascade_decode_attention_matches_reference(dtype, num_splits, group_splits):
    """Rows in groups read positions < their group's prefix through the first member's pages, the
    rest through their own; rows outside groups (and a padded row) read everything themselves."""
    from furlong.engine.cascade import PrefixGroups, cascade_attention_reference, cascade_members
    from furlong.engine.kernels import paged_decode_attention
    g = torch.Generator(device="cuda").manual_seed(10 + num_splits)
    rows, hq, hkv, d, page, pages = 13, 16, 8, 128, 64, 400
    keys = torch.randn(pages, hkv, page, d, device="cuda", generator=g).to(dtype)
    values = torch.randn(pages, hkv, page, d, device="cuda", generator=g).to(dtype)
    lens = torch.tensor([0, 71, 80, 135, 300, 1000, 72, 90, 200, 131, 5, 700, 64], dtype=torch.int32, device="cuda")
    tables = (torch.randperm(pages - 1, device="cuda", generator=g)[:rows * 20] + 1).view(rows, 20).to(torch.int32)
    members = cascade_members(hq, hkv)
    group_rows = torch.full((rows, members), -1, dtype=torch.int32, device="cuda")
    group_rows[0, :8] = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])       # prefix 70: one page and a partial one
    group_rows[1, :2] = torch.tensor([11, 9])                          # prefix 130, first member the longer row
    group_prefix = torch.zeros(rows, dtype=torch.int32, device="cuda")
    group_prefix[:2] = torch.tensor([70, 130])
    prefix_lens = torch.tensor([0, 70, 70, 70, 70, 70, 70, 70, 70, 130, 0, 130, 0], dtype=torch.int32, device="cuda")
    groups = PrefixGroups(prefix_lens, group_rows, group_prefix)
    q = torch.randn(rows, hq, d, device="cuda", generator=g).to(dtype)
    out = paged_decode_attention(q, keys, values, tables, lens, num_splits, prefix=groups, group_splits=group_splits)
    ref = cascade_attention_reference(q.double(), keys.double(), values.double(), tables, lens, groups)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    for r in (10, 12):      # ungrouped rows: as the plain kernel
        plain = paged_decode_attention(q, keys, values, tables, lens, num_splits)
        assert rel_err(out[r], plain[r]) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_store_kv_matches_index_put():
    from furlong.engine.store_kernels import store_kv
    g = torch.Generator(device="cuda").manual_seed(2)
    cache = torch.randn(40, 5, 8, 3, 16, 128, device="cuda", generator=g).to(torch.bfloat16)   # [P, L, K|V.., ]
    keys, values = cache[:, 2, :, 0], cache[:, 3, :, 0]      # strided [P, Hkv=8, page=16, D] views, alike
    ref_k, ref_v = keys.clone(), values.clone()
    page = torch.randperm(40, device="cuda", generator=g)[:23]
    off = torch.randint(0, 16, (23,), device="cuda", generator=g)
    qkv = torch.randn(23, 3 * 8 * 128, device="cuda", generator=g).to(torch.bfloat16)
    k, v = qkv[:, 1024:2048].view(23, 8, 128), qkv[:, 2048:].view(23, 8, 128)              # strided like the engine's
    store_kv(keys, values, page, off, k, v)
    ref_k[page, :, off], ref_v[page, :, off] = k, v
    assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("num_chunks", [None, 1, 32])
def test_triton_sampler_matches_reference(truncate, num_chunks):
    """Every vocabulary split gives the reference's tokens (first index on ties) and log-probs."""
    from furlong.engine.sample_kernels import sample_tokens
    from furlong.engine.sampling import SamplingRows, row_thresholds, sample_reference
    g = torch.Generator(device="cuda").manual_seed(7)
    rows, vocab = 64, 151936
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
    logits[0, 7] = logits[0, 150000] = 40.0     # a greedy row's tie, in the first and the last chunk
    temp = torch.tensor([0.0, 0.5, 1.0, 1.3] * 16, device="cuda")
    r = SamplingRows(inv_temperature=torch.where(temp > 0, 1 / temp.clamp_min(1e-6), 1.0), greedy=temp == 0,
                     top_k=torch.tensor([vocab, 20, 1, vocab] * 16, device="cuda"),
                     top_p=torch.tensor([1.0, 0.9, 1.0, 0.5] * 16, device="cuda"),
                     seed32=torch.randint(0, 2**32, (rows,), device="cuda", generator=g),
                     positions=torch.randint(0, 4000, (rows,), device="cuda", generator=g))
    want_tok, want_lp = sample_reference(logits, r, truncate)
    if truncate:
        thr = row_thresholds(logits.float() * r.inv_temperature[:, None], r.top_k, r.top_p)
        thr = torch.where(r.greedy, float("-inf"), thr)
    else:
        thr = torch.full((rows,), float("-inf"), device="cuda")
    tok, lp = sample_tokens(logits, r.inv_temperature, r.greedy, thr, r.seed32, r.positions, num_chunks=num_chunks)
    assert tok[0] == 7
    assert (tok == want_tok).float().mean() >= 0.97      # log() may differ by an ulp: rare near-ties
    full = torch.log_softmax(logits.float() * r.inv_temperature[:, None], -1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, full, atol=2e-4, rtol=0)


def small_model(dtype, layers=3, std=0.2, embed_std=None):
    from furlong.models.decoder import Transformer
    from furlong.models.hf_config import ModelArgs
    cfg = dict(QWEN3_06B, num_hidden_layers=layers, vocab_size=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = Transformer(ModelArgs.from_hf_config(cfg))
        m.init_weights(std=std)    # 0.2: peaky distributions, argmax well separated
        if embed_std is not None:
            torch.nn.init.normal_(m.embed_tokens.weight, 0.0, embed_std)
    return m.to(dtype).eval()


class NullTok:
    def decode(self, ids, skip_special_tokens=False):
        return ""


@pytest.mark.parametrize("overlap_min_rows", [0, 2])
@torch.inference_mode()
def test_engine_greedy_equals_no_cache_loop_with_graphs(overlap_min_rows):
    """overlap_min_rows 2: windows of 2+ rows run as two halves, the second on a side stream inside the
    captured graphs, cascade groups planned per half (overlap.py)."""
    from furlong.engine import Engine, EngineConfig, Request, SamplingParams
    model = small_model(torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (5, 70, 33, 128, 1, 64, 90)]
    news = [40, 9, 70, 3, 66, 17, 129]
    eng = Engine(model, NullTok(), [], EngineConfig(max_model_len=400, max_num_seqs=8, decode_window=8,
                                                    cascade_min_prefix=1))
    eng.runner.overlap_min_rows = overlap_min_rows
    reqs = [Request(i, p, SamplingParams(temperature=0, max_new_tokens=k, ignore_eos=True), n=1 + i % 3)
            for i, (p, k) in enumerate(zip(prompts, news))]
    out = eng.generate(reqs)
    assert eng.runner.graphs, "decode ran without CUDA graphs"
    # graph keys: (rows, truncate, cascade, splits, halves, fuse_prologue, fp8_kernel)
    assert any(key[2] for key in eng.runner.graphs), "no window ran cascade attention"
    if overlap_min_rows:
        assert any(key[2] and key[4] for key in eng.runner.graphs), "no window ran as halves with cascade groups"
    assert eng.stats.num_grouped_rows > 0
    eng.release()
    for r, comps in zip(reqs, out):
        ids = list(r.prompt_ids)
        for _ in range(r.params.max_new_tokens):
            ids.append(int(model(torch.tensor([ids], device="cuda"))[0, -1].argmax()))
        for c in comps:
            assert c.token_ids == ids[len(r.prompt_ids):], f"request {r.request_id} sample {c.index}"


@torch.inference_mode()
def test_engine_vs_trainer_log_prob_gap_bf16():
    from furlong.engine import Engine, EngineConfig, Request, SamplingParams
    from furlong.trainer.logprobs import chunked_log_probs
    # init like a real checkpoint's scale: layers std 0.02, tied embedding std 0.1, so the logits of the
    # unit-RMS final hidden state have std ~3 (a trained model's spread, entropy a few nats)
    model = small_model(torch.bfloat16, layers=4, std=0.02, embed_std=0.1)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (20, 90, 140)]
    eng = Engine(model, NullTok(), [], EngineConfig(max_model_len=600, max_num_seqs=32))
    out = eng.generate([Request(i, p, SamplingParams(temperature=1.0, max_new_tokens=300, ignore_eos=True), n=4,
                                seed=i) for i, p in enumerate(prompts)])
    eng.release()
    gaps = []
    for p, comps in zip(prompts, out):
        for c in comps:
            ids = torch.tensor(p + c.token_ids, device="cuda")
            cu = torch.tensor([0, len(ids)], dtype=torch.int32, device="cuda")
            hidden = model.forward_packed(ids, torch.arange(len(ids), device="cuda"), cu, len(ids))
            lp = chunked_log_probs(hidden[len(p) - 1:-1], model.output_weight, ids[len(p):], 1.0, compiled=False)
            lp = lp[0] if isinstance(lp, tuple) else lp
            gaps.append((lp.float() - torch.tensor(c.log_probs, device="cuda")).abs())
    gap = torch.cat(gaps).mean().item()
    mean_lp = sum(sum(c.log_probs) for comps in out for c in comps) / sum(len(c.log_probs) for comps in out for c in comps)
    print(f"engine-vs-trainer mean |log-prob gap| (bf16): {gap:.5f}, mean sampled log-prob {mean_lp:.2f}")
    assert gap <= 0.01


@torch.inference_mode()
def test_graphs_survive_release_and_a_resized_cache():
    """release() unmaps the KV memory (the trainer gets it back); the next session maps another size at
    the same address, so the graphs captured in the first session replay correctly in the second."""
    from furlong.engine import Engine, EngineConfig, Request, SamplingParams
    model = small_model(torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (17, 70, 5)]
    eng = Engine(model, NullTok(), [], EngineConfig(max_model_len=300, max_num_seqs=8, kv_fraction=0.05))
    run = lambda: eng.generate([Request(i, p, SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True),  # noqa: E731
                                        n=2) for i, p in enumerate(prompts)])
    first = run()
    captured = dict(eng.runner.graphs)
    assert captured and eng.runner.cache_memory.stable, "stable KV memory unavailable: cuda.bindings missing?"
    free_before, kv_bytes = torch.cuda.mem_get_info()[0], eng.runner.kv_bytes
    eng.release()
    assert torch.cuda.mem_get_info()[0] >= free_before + 0.9 * kv_bytes   # the memory really went back
    hog = torch.empty(int(torch.cuda.mem_get_info()[0] * 0.5), dtype=torch.uint8, device="cuda")  # the trainer
    second = run()                                                     # a smaller cache this session
    assert eng.runner.graphs == captured                               # no graph was re-captured
    assert [[c.token_ids for c in cs] for cs in second] == [[c.token_ids for c in cs] for cs in first]
    del hog
    eng.release()


def test_weights_after_sync_equal_the_trainers_gathered_weights(tmp_path):
    """A trained step on the GPU actor, then weight sync into an engine that already ran (fused
    views, captured graphs): every engine parameter equals the actor's gathered weight in bf16."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_actor import synthetic_samples, tiny_config
    from tiny_checkpoints import write_tiny_checkpoint
    from furlong.engine import Engine, EngineConfig, Request, SamplingParams
    from furlong.models.hf_io import load_pretrained
    from furlong.config_map import actor_config, batching_config
    from furlong.trainer.actor import Actor
    from furlong.launch.distributed import init_distributed
    from furlong.trainer.weight_sync import sync_weights
    ckpt = write_tiny_checkpoint(tmp_path / "c", vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2,
                                 tie=False, init_std=0.05)
    ctx = init_distributed("auto")
    actor = Actor(load_pretrained(ckpt, dtype=torch.float32, device=ctx.device), actor_config(tiny_config()), ctx)
    actor.train_step(synthetic_samples([9, 14, 7, 20]), batching_config(tiny_config()))
    eng = Engine(load_pretrained(ckpt, dtype=torch.bfloat16, device=ctx.device), NullTok(), [],
                 EngineConfig(max_model_len=64, max_num_seqs=4, kv_fraction=0.02))
    with torch.inference_mode():
        eng.generate([Request(0, [1, 2, 3], SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))])
    sync_weights(actor.model, eng.model, bucket_bytes=1 << 16)
    engine_params = dict(eng.model.named_parameters())
    for name, p in actor.model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        assert torch.equal(engine_params[name], full.detach().to(torch.bfloat16)), name
    w = eng.runner.forward.layers[0]
    q = eng.model.layers[0].self_attn.q_proj.weight
    assert w.qkv_w.data_ptr() == q.data_ptr() and torch.equal(w.qkv_w[:q.shape[0]], q)
