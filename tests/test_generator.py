"""Generation engine: static KV cache decoding vs. a no-cache reference, sampling, stopping."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from furlong.models.hf_io import load_pretrained
from furlong.rollout.generator import Generator
from furlong.rollout.kv_cache import StaticKVCache
from furlong.rollout.sampling import SamplingParams, sample_next
from tiny_checkpoints import write_tiny_checkpoint

EOS = 2   # <|im_end|> in the tiny tokenizer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3", vocab_size=128, hidden=64,
                                 layers=2, heads=4, kv_heads=2, seed=0)
    return load_pretrained(path, dtype=torch.float32, device="cpu"), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def prompts(ckpt):
    _, tok = ckpt
    texts = ["Hi", "What is 2 + 3?", "abc", "A much longer prompt with several words in it."]
    return [tok(t)["input_ids"] for t in texts]   # lengths 2, 14, 3, 46: not sorted, padding differs


def reference_greedy(model, prompt, num_new):
    """Plain argmax loop: a full forward over the growing sequence every step, no cache."""
    ids = list(prompt)
    for _ in range(num_new):
        logits = model(torch.tensor([ids]))[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def reference_log_probs(model, prompt, response, temperature):
    logits = model(torch.tensor([prompt + response]))[0, len(prompt) - 1:-1].float()   # [R, V]
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(response)[:, None])[:, 0], logits


def gen(ckpt, eos=(EOS,), max_batch_size=3, **kw):
    model, tok = ckpt
    return Generator(model, tok, eos_token_ids=list(eos), max_batch_size=max_batch_size, device="cpu", **kw)


@pytest.mark.parametrize("kv_bucket,check_interval", [(64, 8), (4, 3)])
@torch.inference_mode()
def test_greedy_matches_no_cache_loop(ckpt, prompts, kv_bucket, check_interval):
    model, _ = ckpt
    g = gen(ckpt, max_batch_size=3, kv_bucket=kv_bucket, check_interval=check_interval)
    out = g.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, out):
        want = reference_greedy(model, p, 10)
        assert o.token_ids == want
        assert o.finish_reason == "length"
        lp, _ = reference_log_probs(model, p, want, 1.0)
        assert torch.allclose(torch.tensor(o.log_probs), lp, atol=1e-4)


@torch.inference_mode()
def test_sampled_log_probs_match_full_forward(ckpt, prompts):
    model, _ = ckpt
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, ignore_eos=True, seed=5)
    out = gen(ckpt).generate(prompts, params)
    for p, o in zip(prompts, out):
        assert len(o.token_ids) == len(o.log_probs) == 12
        lp, logits = reference_log_probs(model, p, o.token_ids, 0.7)
        assert torch.allclose(torch.tensor(o.log_probs), lp, atol=1e-4)
        # every sampled token is within the top-20 of its position
        top20 = logits.topk(20, dim=-1).indices
        assert all(t in top20[i] for i, t in enumerate(o.token_ids))


def test_seeded_determinism(ckpt, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=11)
    a = gen(ckpt).generate(prompts, params)
    b = gen(ckpt, max_batch_size=3).generate(prompts, params)
    c = gen(ckpt).generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=12))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.log_probs for o in a] == [o.log_probs for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_n_samples_of_one_prompt_differ(ckpt, prompts):
    out = gen(ckpt, max_batch_size=8).generate([prompts[1]] * 6, SamplingParams(temperature=1.0, max_new_tokens=10,
                                                                                  ignore_eos=True, seed=0))
    assert len({tuple(o.token_ids) for o in out}) == 6


@pytest.mark.parametrize("via", ["eos", "stop_token_ids"])
def test_stops_at_eos_or_stop_token_and_keeps_it(ckpt, prompts, via):
    model, tok = ckpt
    base = gen(ckpt).generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    stop_tok = base[1].token_ids[4]    # make the 5th greedy token of prompt 1 the stop token
    if via == "eos":
        g, params = gen(ckpt, eos=[stop_tok]), SamplingParams(temperature=0, max_new_tokens=12)
    else:
        g, params = gen(ckpt, eos=[]), SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[stop_tok])
    out = g.generate(prompts, params)
    for b, o in zip(base, out):
        if stop_tok in b.token_ids:
            n = b.token_ids.index(stop_tok) + 1
            assert (o.token_ids, o.finish_reason) == (b.token_ids[:n], "stop")
            assert o.log_probs == pytest.approx(b.log_probs[:n], abs=1e-5)
            assert o.text == tok.decode(b.token_ids[:n], skip_special_tokens=False)
        else:
            assert (o.token_ids, o.finish_reason) == (b.token_ids, "length")
    assert out[1].finish_reason == "stop" and len(out[1].token_ids) <= 5
    # ignore_eos forces the full length even with the EOS in the output
    forced = g.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True,
                                                stop_token_ids=[]))
    if via == "eos":
        assert [o.token_ids for o in forced] == [b.token_ids for b in base]


@pytest.mark.parametrize("check_interval", [1, 3, 16])
def test_stop_string(ckpt, prompts, check_interval):
    _, tok = ckpt
    params = dict(temperature=0, max_new_tokens=16, ignore_eos=True)
    base = gen(ckpt).generate(prompts, SamplingParams(**params))
    stop = base[3].text[5:7]          # a 2-character string the greedy output of prompt 3 contains
    assert len(stop) == 2
    out = gen(ckpt, check_interval=check_interval).generate(prompts, SamplingParams(stop=[stop, "never!"], **params))
    for b, o in zip(base, out):
        if stop not in b.text:
            assert (o.token_ids, o.text, o.finish_reason) == (b.token_ids, b.text, "length")
            continue
        cut = b.text.index(stop) + len(stop)
        assert o.finish_reason == "stop"
        assert o.text == b.text[:cut] and o.text.endswith(stop)
        assert o.token_ids == b.token_ids[:len(o.token_ids)]
        # the last kept token completes the stop string; one fewer does not contain it
        assert stop in tok.decode(o.token_ids) and stop not in tok.decode(o.token_ids[:-1])
        assert len(o.log_probs) == len(o.token_ids)
    assert out[3].finish_reason == "stop" and len(out[3].token_ids) <= 7


def test_max_length_and_batch_chunking(ckpt, prompts):
    out = gen(ckpt, max_batch_size=1).generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=5,
                                                                       ignore_eos=True, seed=1))
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in out)
    with pytest.raises(ValueError, match="empty"):
        gen(ckpt).generate([[]], SamplingParams())


def test_sample_next_truncation_and_frequencies():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    tok, lp = sample_next(logits, SamplingParams(temperature=1.0), g)
    freq = torch.bincount(tok, minlength=4).float() / tok.numel()
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015)
    assert torch.allclose(lp, torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[tok], atol=1e-5)
    tok, lp = sample_next(logits, SamplingParams(temperature=1.0, top_k=2), g)
    freq = torch.bincount(tok, minlength=4).float() / tok.numel()
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.5 / 0.8) < 0.015
    # log-prob is over the full vocabulary, not the truncated one
    assert torch.allclose(lp, torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[tok], atol=1e-5)
    tok, _ = sample_next(logits, SamplingParams(temperature=1.0, top_p=0.7), g)   # keeps {0.5, 0.3}
    assert set(tok.tolist()) == {0, 1}
    tok, lp = sample_next(logits[:2], SamplingParams(temperature=0), g)
    assert tok.tolist() == [0, 0] and torch.allclose(lp, torch.full((2,), math.log(0.5)))
    tok, lp = sample_next(logits[:4], SamplingParams(temperature=2.0), g)
    want = torch.log_softmax(logits[0] / 2.0, dim=-1)[tok]
    assert torch.allclose(lp, want, atol=1e-6)


def test_kv_cache_mask_and_offsets():
    cache = StaticKVCache(num_layers=2, batch_size=2, num_kv_heads=1, head_dim=4, max_len=8,
                          dtype=torch.float32, device="cpu", bucket=8)
    valid = torch.tensor([[False, True, True], [True, True, True]])
    cache.begin_step(valid)
    k = torch.randn(2, 1, 3, 4)
    _, _, m0 = cache.update(0, k, k)
    keys, _, m1 = cache.update(1, k, k)
    assert cache.offset == 3 and keys.shape == (2, 1, 8, 4) and torch.equal(keys[:, :, :3], k)
    assert m0 is m1 and m0.shape == (2, 1, 3, 8)
    # row 0: pad slot 0 is seen only by itself; real queries see real keys causally
    assert m0[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]
    assert m0[1, 0, 2].int().tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    # a step without begin_step: all new tokens valid, one step per pass through the layers
    k1 = torch.randn(2, 1, 1, 4)
    _, _, m = cache.update(0, k1, k1)
    cache.update(1, k1, k1)
    assert cache.offset == 4 and m[0, 0, 0].int().tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="exceed max_len"):
        cache.begin_step(torch.ones(2, 5, dtype=torch.bool))


@torch.inference_mode()
def test_compaction_keeps_greedy_outputs(ckpt, prompts, monkeypatch):
    """Rows that stop early are taken out of the batch; the survivors decode exactly as before."""
    model, _ = ckpt
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    full = gen(ckpt, max_batch_size=4, compact_ratio=0.0).generate(prompts, params)
    # stop tokens that the greedy responses hit at different steps, so rows finish apart
    firsts = {o.token_ids[k] for o, k in zip(full, (15, 11, 7, 3))}   # longest prompt (slot 0) first
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, stop_token_ids=sorted(firsts))
    calls = []
    real_keep = StaticKVCache.keep_rows
    monkeypatch.setattr(StaticKVCache, "keep_rows", lambda self, rows: (calls.append(rows.numel()),
                                                                      real_keep(self, rows))[1])
    plain = gen(ckpt, max_batch_size=4, compact_ratio=0.0, check_interval=1).generate(prompts, params)
    assert calls == []
    compacted = gen(ckpt, max_batch_size=4, compact_ratio=1.0, check_interval=1).generate(prompts, params)
    assert calls, "no row was compacted away"
    assert [o.token_ids for o in compacted] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in compacted] == [o.finish_reason for o in plain]
    for a, b in zip(compacted, plain):
        assert torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5)
    for p, o in zip(prompts, compacted):   # and against the no-cache reference
        assert o.token_ids == reference_greedy(model, p, len(o.token_ids))
