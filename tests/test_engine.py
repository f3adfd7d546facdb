"""The rollout engine on CPU against plain no-cache loops over the same model.

Continuous batching, paged KV with prefix sharing and preemption, sampling and stopping."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from furlong.engine import Engine, EngineConfig, Request, SamplingParams
from furlong.engine.block_manager import BlockManager
from furlong.engine.sampling import SamplingRows, row_thresholds, sample_reference
from furlong.models.hf_io import load_pretrained
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
    texts = ["Hi", "What is 2 + 3?", "abc", "A much longer prompt with several words in it.", "x" * 17]
    return [tok(t)["input_ids"] for t in texts]


def engine(ckpt, eos=(EOS,), **kw):
    model, tok = ckpt
    # cascade_min_prefix 1: these short prompts still form cascade groups (tested against no-cache loops)
    cfg = dict(page_size=8, decode_window=4, max_num_seqs=6, cpu_kv_tokens=1024, max_model_len=128,
               cascade_min_prefix=1)
    cfg.update(kw)
    return Engine(model, tok, list(eos), EngineConfig(**cfg))


@torch.no_grad()
def reference_greedy(model, prompt, num_new):
    """Plain argmax loop: a full forward over the growing sequence every step, no cache."""
    ids = list(prompt)
    for _ in range(num_new):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def reference_log_probs(model, prompt, response, temperature):
    logits = model(torch.tensor([prompt + response]))[0, len(prompt) - 1:-1].float()   # [R, V]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0], logits


def greedy(n):
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("kw", [dict(), dict(decode_window=1), dict(page_size=4, decode_window=3, max_num_seqs=3),
                                dict(cpu_kv_tokens=96, page_size=8, decode_window=2, mix_prefill=False)])
def test_greedy_equals_no_cache_loop_with_joins_leaves_and_sharing(ckpt, prompts, kw):
    """Different prompt and response lengths, n > 1 (prefix sharing), few running slots (rows join as
    others leave), and a cache so small that sequences get preempted and recomputed."""
    model, _ = ckpt
    eng = engine(ckpt, **kw)
    news = [7, 12, 3, 20, 9]
    reqs = [Request(i, p, greedy(k), n=1 + i % 3) for i, (p, k) in enumerate(zip(prompts, news))]
    out = eng.generate(reqs)
    for r, comps in zip(reqs, out):
        want = reference_greedy(model, r.prompt_ids, r.params.max_new_tokens)
        assert [c.index for c in comps] == list(range(r.n))
        for c in comps:
            assert c.token_ids == want and c.finish_reason == "length"
            lp, _ = reference_log_probs(model, r.prompt_ids, want, 1.0)
            torch.testing.assert_close(torch.tensor(c.log_probs), lp, atol=1e-4, rtol=0)
    if kw.get("cpu_kv_tokens") == 96:
        assert eng.stats.num_preemptions > 0       # the small cache really forced recomputation
    assert eng.stats.num_grouped_rows > 0         # samples of one request read their prompt through a group
    assert eng.scheduler.blocks.num_used == 0     # every page back


def test_sampled_log_probs_match_and_seeds_repeat(ckpt, prompts):
    model, _ = ckpt
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, ignore_eos=True)
    run = lambda seed, **kw: engine(ckpt, **kw).generate([Request(i, p, params, n=3, seed=seed + i)  # noqa: E731
                                                          for i, p in enumerate(prompts)])
    out = run(5)
    for p, comps in zip(prompts, out):
        for c in comps:
            assert len(c.token_ids) == len(c.log_probs) == 12
            lp, logits = reference_log_probs(model, p, c.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(c.log_probs), lp, atol=1e-4, rtol=0)
            top20 = logits.topk(20, dim=-1).indices
            assert all(t in top20[i] for i, t in enumerate(c.token_ids))
    assert len({tuple(c.token_ids) for comps in out for c in comps}) > len(prompts)   # samples differ
    again = run(5, decode_window=3, max_num_seqs=4)         # other batching, same draws
    assert [[c.token_ids for c in cs] for cs in again] == [[c.token_ids for c in cs] for cs in out]
    other = run(6)
    assert [[c.token_ids for c in cs] for cs in other] != [[c.token_ids for c in cs] for cs in out]


def test_stop_tokens_stop_strings_and_per_request_lengths(ckpt, prompts):
    model, tok = ckpt
    base = engine(ckpt).generate([Request(i, p, greedy(12)) for i, p in enumerate(prompts)])
    stop_tok = base[1][0].token_ids[4]
    first = base[1][0].token_ids.index(stop_tok)
    out = engine(ckpt, eos=[stop_tok]).generate([Request(0, prompts[1], SamplingParams(temperature=0,
                                                                                       max_new_tokens=12))])
    assert out[0][0].token_ids == base[1][0].token_ids[:first + 1] and out[0][0].finish_reason == "stop"
    out = engine(ckpt, eos=[]).generate([Request(0, prompts[1], SamplingParams(
        temperature=0, max_new_tokens=12, stop_token_ids=[stop_tok]))])
    assert out[0][0].token_ids == base[1][0].token_ids[:first + 1]
    # a stop string spanning tokens: text cut right after it, tokens up to the completing one
    text = tok.decode(base[3][0].token_ids)
    stop = text[5:8]
    out = engine(ckpt, eos=[]).generate([Request(0, prompts[3], SamplingParams(temperature=0, max_new_tokens=12,
                                                                               stop=[stop, "never!"]))])
    c = out[0][0]
    assert c.finish_reason == "stop" and c.text.endswith(stop) and stop not in c.text[:-1]
    assert c.token_ids == base[3][0].token_ids[:len(c.token_ids)]
    assert stop in tok.decode(c.token_ids) and stop not in tok.decode(c.token_ids[:-1])
    # per-sample forced lengths: each row stops at its own length
    r = Request(0, prompts[0], greedy(30), n=3, sample_max_new_tokens=[2, 30, 9])
    assert [len(c.token_ids) for c in engine(ckpt).generate([r])[0]] == [2, 30, 9]


def test_abort_and_streaming_steps(ckpt, prompts):
    eng = engine(ckpt)
    for i, p in enumerate(prompts):
        eng.add(Request(i, p, greedy(5 + 10 * i)))
    finished = []
    while len(finished) < 2:
        finished += eng.step()
    assert [c.request_id for c in finished] == [0, 1]          # short requests leave first
    aborted = eng.abort({2, 3, 4})
    assert {c.request_id for c in aborted} <= {2, 3, 4} and all(c.finish_reason == "abort" for c in aborted)
    assert not eng.has_work() and eng.scheduler.blocks.num_used == 0
    eng.release()
    assert eng.runner.cache is None
    assert engine(ckpt).generate([Request(0, prompts[0], greedy(3))])[0][0].finish_reason == "length"


def test_bad_requests_are_one_line_errors(ckpt, prompts):
    eng = engine(ckpt)
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add(Request(0, [], greedy(3)))
    with pytest.raises(ValueError, match="max length"):
        eng.add(Request(1, prompts[0], greedy(500)))
    eng.add(Request(9, prompts[0], greedy(3)))
    with pytest.raises(ValueError, match="request id 9 is already"):
        eng.add(Request(9, prompts[1], greedy(3)))
    with pytest.raises(ValueError, match="--rollout-max-num-seqs"):
        eng.add(Request(3, prompts[0], greedy(3), n=7))
    with pytest.raises(ValueError, match="KV pages"):
        engine(ckpt, cpu_kv_tokens=32).add(Request(2, prompts[3], greedy(60)))


def test_block_manager_shares_full_pages_and_copies_the_last():
    bm = BlockManager(num_blocks=10, block_size=4)
    table = []
    bm.grow(table, 10)                       # 3 pages, the last one half full
    assert len(table) == 3 and 0 not in table and bm.num_free == 6
    tables, copies = bm.fork(table, 10, 3)
    assert [t[:2] for t in tables] == [table[:2]] * 3            # full pages shared
    assert len(copies) == 2 and all(src == table[2] for src, _ in copies)
    assert len({t[2] for t in tables}) == 3 and bm.num_free == 4
    for t in tables[1:]:
        bm.release(t)
    assert bm.num_free == 6
    bm.release(tables[0])
    assert bm.num_free == 9
    assert bm.fork_cost(8, 4) == 0 and bm.fork_cost(9, 4) == 3


def test_sampler_thresholds_and_greedy():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    rows = SamplingRows(inv_temperature=torch.ones(4), greedy=torch.tensor([False, False, False, True]),
                        top_k=torch.tensor([2, 4, 4, 4]), top_p=torch.tensor([1.0, 0.7, 1.0, 1.0]),
                        seed32=torch.arange(4), positions=torch.zeros(4, dtype=torch.long))
    thr = row_thresholds(logits, rows.top_k, rows.top_p)
    torch.testing.assert_close(thr[:3], logits[0, [1, 1, 3]])     # top-2; top-p 0.7 keeps {0.5, 0.3}; all
    counts = torch.zeros(3, 4)
    for pos in range(400):
        rows.positions = torch.full((4,), pos)
        tok, lp = sample_reference(logits, rows, truncate=True)
        counts[torch.arange(3), tok[:3]] += 1
        assert tok[3] == 0                                        # greedy row
        torch.testing.assert_close(lp, logits[0, tok])            # full-vocab log-prob at T=1
    assert counts[0, 2:].sum() == 0 and counts[1, 2:].sum() == 0  # truncated tokens never drawn
    assert abs(counts[2, 0] / 400 - 0.5) < 0.08 and counts[2, 3] > 0   # untruncated row follows p
    assert abs(counts[0, 0] / 400 - 0.625) < 0.08                  # top-2 renormalised: 0.5 / 0.8


def test_weight_sync_by_name_reaches_the_fused_engine_weights(ckpt, prompts, tmp_path):
    """The engine fuses q/k/v and gate/up into single tensors; copying new weights into the
    model's parameters by name (what weight sync does) must change what the engine computes."""
    _, tok = ckpt
    other_path = write_tiny_checkpoint(tmp_path, family="qwen3", vocab_size=128, hidden=64, layers=2, heads=4,
                                       kv_heads=2, seed=1)
    other = load_pretrained(other_path, dtype=torch.float32, device="cpu")
    model_a = load_pretrained(write_tiny_checkpoint(tmp_path / "a", family="qwen3", vocab_size=128, hidden=64,
                                                    layers=2, heads=4, kv_heads=2, seed=0), dtype=torch.float32)
    eng = Engine(model_a, tok, [], EngineConfig(page_size=8, decode_window=4, max_num_seqs=4, cpu_kv_tokens=512))
    eng.generate([Request(0, prompts[1], greedy(4))])        # built and used with the first weights
    with torch.no_grad():
        src = dict(other.named_parameters())
        for name, p in model_a.named_parameters():
            p.copy_(src[name])
    out = eng.generate([Request(1 + i, p, greedy(8)) for i, p in enumerate(prompts[:3])])
    for p, comps in zip(prompts, out):
        assert comps[0].token_ids == reference_greedy(other, p, 8)


def test_top_k_1_is_greedy_at_any_temperature(ckpt, prompts):
    """--eval-top-k 1 with --rollout-temperature 1 (the reference flag block's eval): argmax tokens."""
    model, _ = ckpt
    params = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=10, ignore_eos=True)
    out = engine(ckpt).generate([Request(i, p, params, seed=i) for i, p in enumerate(prompts)])
    for p, comps in zip(prompts, out):
        assert comps[0].token_ids == reference_greedy(model, p, 10)


def test_engine_applies_yarn_like_the_model(tmp_path, prompts):
    """A YaRN-scaled checkpoint (scaled frequencies, cos/sin times the attention factor): the engine's
    own forward decodes what the model's full forward picks, token by token."""
    path = write_tiny_checkpoint(tmp_path, family="qwen3", vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2,
                                 seed=5, rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                                       "original_max_position_embeddings": 16})
    model = load_pretrained(path, dtype=torch.float32, device="cpu")
    assert model.rope_attention_factor > 1.2
    eng = Engine(model, AutoTokenizer.from_pretrained(path), [], EngineConfig(page_size=8, decode_window=4,
                                                                              cpu_kv_tokens=512, max_num_seqs=4))
    out = eng.generate([Request(i, p, greedy(24)) for i, p in enumerate(prompts[:3])])
    for p, comps in zip(prompts, out):
        assert comps[0].token_ids == reference_greedy(model, p, 24)


def test_staged_decode_inputs_follow_sequences_not_object_ids(ckpt, prompts, monkeypatch):
    """The runner re-stages a row's sampling inputs and block table when another sequence takes it,
    even if the new object has the old one's id (CPython reuses the address of a freed object):
    with every id() in the runner the same, a changed running set must still be re-staged."""
    import furlong.engine.decode_inputs as decode_inputs
    import furlong.engine.model_runner as model_runner
    for module in (model_runner, decode_inputs):
        monkeypatch.setattr(module, "id", lambda obj: 0, raising=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    eng = engine(ckpt, max_num_seqs=2, decode_window=2)
    # two rows at a time: as one finishes, a waiting request takes its row with another seed and pages
    out = eng.generate([Request(i, prompts[i % 2], params, seed=10 + i,
                                sample_max_new_tokens=[2 + 2 * (i % 2)]) for i in range(4)])
    for i, (comps, req_prompt) in enumerate(zip(out, [prompts[i % 2] for i in range(4)])):
        alone = engine(ckpt).generate([Request(0, req_prompt, params, seed=10 + i,
                                               sample_max_new_tokens=[2 + 2 * (i % 2)])])[0][0]
        assert comps[0].token_ids == alone.token_ids, f"request {i}"


def test_postprocess_counts_kept_tokens_and_reset_stats_starts_anew(ckpt, prompts):
    """The scheduler's postprocess counts each kept token once (a stop string's dropped tail not
    at all), every prefill and decode window; reset_stats hands the counts over and starts at zero
    while the same session goes on counting."""
    _, tok = ckpt
    base = engine(ckpt).generate([Request(0, prompts[3], greedy(12))])[0][0]
    stop = tok.decode(base.token_ids)[5:8]
    eng = engine(ckpt, eos=[])
    reqs = [Request(0, prompts[3], SamplingParams(temperature=0, max_new_tokens=12, stop=[stop])),
            Request(1, prompts[0], greedy(9), n=2)]
    out = eng.generate(reqs)
    stats = eng.reset_stats()
    assert out[0][0].finish_reason == "stop" and len(out[0][0].token_ids) < 12
    assert stats.num_generated_tokens == sum(len(c.token_ids) for cs in out for c in cs)
    assert stats.num_prefill_steps >= 1 and stats.num_prefill_tokens == len(prompts[3]) + len(prompts[0])
    assert stats.num_decode_steps >= 8 and stats.num_windows >= 2 and 0 < stats.kv_utilization <= 1
    assert eng.stats.num_generated_tokens == 0 and eng.stats.num_windows == 0
    again = eng.generate([Request(2, prompts[1], greedy(5))])
    assert eng.stats.num_generated_tokens == 5 == len(again[0][0].token_ids)


@pytest.mark.parametrize("window", [1, 4])
def test_stats_count_the_context_each_decode_row_attends_to(ckpt, window):
    """EngineStats.num_context_tokens: a row with T tokens attends to T at its next decode step; its first
    token comes from the prefill, and a window runs whole for every row in it (a row that ends inside it
    still computes it); the window is cut to the longest row's remaining tokens."""
    eng = engine(ckpt, decode_window=window)
    p, r0, r1 = 5, 10, 7
    eng.generate([Request(0, list(range(3, 3 + p)), greedy(r0)), Request(1, list(range(3, 3 + 2 * p)), greedy(r1))])
    st = eng.reset_stats()
    steps0 = r0 - 1                                   # the longest row sets the windows
    steps1 = -(-(r1 - 1) // window) * window          # the shorter one: its windows, whole (8 at window 4)
    ctx = lambda prompt, n: sum(prompt + 1 + j for j in range(n))   # noqa: E731
    assert st.num_decode_steps == steps0 and st.num_decode_rows == steps0 + steps1
    assert st.num_context_tokens == ctx(p, steps0) + ctx(2 * p, steps1)
    assert st.mean_context == pytest.approx(st.num_context_tokens / (steps0 + steps1))


def causal_attends(a, n: int):
    """(attend, attend_qkv) for EngineForward.hidden over one sequence of n tokens, in plain torch: attend
    causally over it; attend_qkv applies qk-norm and RoPE to the projection itself, then attends."""
    from furlong.engine.forward import rms_norm, rope
    from furlong.models.attention import packed_attention
    cu = torch.tensor([0, n], dtype=torch.int32)

    def attend(layer, q, k, v):
        return packed_attention(q, k, v, cu, n)

    def attend_qkv(layer, qkv, q_norm, k_norm, cos, sin, eps):
        t, d = qkv.shape[0], a.head_dim
        q, k, v = qkv.split([a.num_heads * d, a.num_kv_heads * d, a.num_kv_heads * d], dim=-1)
        q, k, v = q.reshape(t, -1, d), k.reshape(t, -1, d), v.reshape(t, -1, d)
        return attend(layer, rope(rms_norm(q, q_norm, eps), cos, sin), rope(rms_norm(k, k_norm, eps), cos, sin), v)
    return attend, attend_qkv


@torch.no_grad()
def test_forward_hands_attend_qkv_the_projection_pre_attention_norms_and_ropes(ckpt):
    """EngineForward.hidden's fused-prologue path (decode on CUDA: store_kernels.decode_prologue) gets the
    q|k|v projection, the norm weights, cos/sin and eps such that qk-norm + RoPE of it are exactly
    pre_attention's q, k, v: the same hidden states as the unfused path, here with both attending causally
    over the token's own sequence in plain torch."""
    from furlong.engine.forward import EngineForward
    model, _ = ckpt
    fwd = EngineForward(model, compile=False)
    ids, pos = torch.tensor([5, 9, 17, 3, 44, 101]), torch.arange(6)
    attend, attend_qkv = causal_attends(fwd.args, 6)
    assert fwd.layers[0].qn_w is not None                     # Qwen3: the norms are exercised
    torch.testing.assert_close(fwd.hidden(ids, pos, attend, attend_qkv), fwd.hidden(ids, pos, attend), rtol=0, atol=0)


@torch.no_grad()
def test_compiled_forward_keeps_residual_adds_out_of_the_matmuls(ckpt, tmp_path):
    """Compiled (CPU inductor here, the same pattern passes as on CUDA), the engine's layer blocks have no
    addmm: a residual add folded into a matmul costs a copy of x per add on CUDA and rounds once where the
    trainer (models/decoder.py) rounds the projection first. The compiled hidden states agree with the eager
    ones in bf16 (the compiler keeps fused elementwise chains in fp32, so not bit for bit), on both the
    fused-prologue path and the plain one."""
    from torch._inductor.utils import run_and_get_code

    from furlong.engine.forward import EngineForward
    path = write_tiny_checkpoint(tmp_path, family="qwen3", vocab_size=128, hidden=64, layers=3, heads=4,
                                 kv_heads=2, seed=1)
    eager = EngineForward(load_pretrained(path, dtype=torch.bfloat16, device="cpu"), compile=False)
    compiled = EngineForward(load_pretrained(path, dtype=torch.bfloat16, device="cpu"), compile=True)
    ids, pos = torch.tensor([5, 9, 17, 3, 44, 101, 7]), torch.arange(7)
    attend, attend_qkv = causal_attends(eager.args, 7)
    for fused in (None, attend_qkv):
        got, code = run_and_get_code(compiled.hidden, ids, pos, attend, fused)
        assert code and not any("addmm" in c for c in code)
        want = eager.hidden(ids, pos, attend, fused).float()
        assert (got.float() - want).norm() / want.norm() < 3e-2      # measured 1.3%: a few bf16 roundings
