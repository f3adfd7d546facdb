"""Bench parts that generate: `rollout` (the step's responses), the `decode` probe and the
`eval` probe, all on the engine (furlong.engine).

  rollout  the step's 32 prompts x 8 samples as 32 requests of n=8 (each prompt
           prefilled once), every sample forced to its own length from the
           workload (ignore_eos, per-sample max_new_tokens): each row stops at
           its own length. `first_seconds`: the first rollout of a run (CUDA-graph
           captures of every batch size it passes through; kernels already
           compiled by a short warm-up). `seconds`: a later rollout, as every RL
           step after the first pays it: a new session (the KV cache released
           for training and mapped again) over the graphs kept from the first.
  decode   B x P random prompts, exactly N new tokens each, on the engine and on
           transformers `generate` (same weights, sampling, sdpa). If HF's warm-up
           predicts more than `hf_max_seconds` for N tokens, HF runs fewer tokens
           and the engine is re-run at that count for the ratio.
  eval     `eval_num_prompts` prompts with the workload's prompt lengths (cycled),
           greedy, max `eval_max_new_tokens`; random weights rarely emit EOS, so
           rows run long. Timed from a fresh session.
"""
from __future__ import annotations

import torch

from furlong.bench.measure import free_memory, peak_gib, rate, reset_peak, timed
from furlong.bench.report import DecodeResult, EvalProbeResult, RolloutResult
from furlong.bench.state import Bench, NullTokenizer, build_hf_model


def make_engine(b: Bench, max_model_len: int, max_num_seqs: int = 512):
    from furlong.engine import Engine, EngineConfig
    return Engine(b.engine(), NullTokenizer(), eos_token_ids=[],
                  config=EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs, kv_dtype=b.kv_dtype))


def _params(b: Bench, new_tokens: int, temperature: float | None = None):
    from furlong.engine import SamplingParams
    t = b.w.temperature if temperature is None else temperature
    return SamplingParams(temperature=t, top_p=b.w.top_p, top_k=b.w.top_k, max_new_tokens=new_tokens,
                          ignore_eos=True)


def _rollout_requests(b: Bench, prompts: list[list[int]], seed: int):
    from furlong.engine import Request
    w, n = b.w, b.w.n_samples_per_prompt
    return [Request(request_id=i, prompt_ids=p, params=_params(b, max(w.response_lens)), n=n, seed=seed + i,
                    sample_max_new_tokens=w.response_lens[i * n:(i + 1) * n]) for i, p in enumerate(prompts)]


def part_rollout(b: Bench) -> RolloutResult:
    w, dev = b.w, b.device
    g = torch.Generator().manual_seed(b.seed + 2)
    prompts = [torch.randint(0, b.args.vocab_size, (p,), generator=g).tolist() for p in w.prompt_lens]
    engine = make_engine(b, max(w.prompt_lens) + max(w.response_lens))
    engine.generate(_rollout_requests(b, prompts[:1], seed=100))                # warm-up: kernels compile
    engine.release()
    _, first_s = timed(lambda: engine.generate(_rollout_requests(b, prompts, seed=1)), dev)
    engine.release()
    engine.reset_stats()
    reset_peak(dev)
    outs, secs = timed(lambda: engine.generate(_rollout_requests(b, prompts, seed=0)), dev)
    stats = engine.reset_stats()
    peak = peak_gib(dev)
    kv_gib = engine.runner.kv_bytes / 2**30
    engine.release()
    plain_s = None
    if stats.num_grouped_rows:
        # side by side: cascade off (its graphs captured by an untimed rollout first), same prompts
        engine.runner.cascade = False
        engine.generate(_rollout_requests(b, prompts, seed=1))
        engine.release()
        _, plain_s = timed(lambda: engine.generate(_rollout_requests(b, prompts, seed=0)), dev)
        engine.runner.cascade = True
        engine.release()
    got = [len(c.token_ids) for cs in outs for c in cs]
    if got != list(w.response_lens):
        bad = next(i for i, (a, r) in enumerate(zip(got, w.response_lens)) if a != r)
        raise RuntimeError(f"engine sample {bad} has {got[bad]} tokens, forced length {w.response_lens[bad]}")
    forced = sum(got)
    return RolloutResult(
        num_samples=w.num_samples, max_new_tokens=max(w.response_lens), num_forced_tokens=forced, seconds=secs,
        tok_per_s=rate(forced, secs), first_seconds=first_s, decode_steps=stats.num_decode_steps,
        decode_steps_per_s=rate(stats.num_decode_steps, secs), mean_running_batch=stats.mean_batch,
        kv_utilization=stats.kv_utilization, num_preemptions=stats.num_preemptions, peak_gib=peak, kv_cache_gib=kv_gib,
        cascade_row_fraction=stats.grouped_fraction, no_cascade_seconds=plain_s,
        note="32 requests x n=8 (prompt prefilled once), each sample forced to its own length (ignore_eos); "
             "seconds: a new session over kept graphs (every step after the first); first_seconds: the first "
             "rollout, graph captures included; no_cascade_seconds: the same with cascade off, same run (None: "
             "no row used cascade)")


def part_decode(b: Bench) -> DecodeResult:
    from furlong.engine import Request
    w, dev = b.w, b.device
    g = torch.Generator().manual_seed(b.seed + 3)
    prompts = torch.randint(0, b.args.vocab_size, (w.decode_batch, w.decode_prompt_len), generator=g)
    n = w.decode_new_tokens
    engine = make_engine(b, w.decode_prompt_len + n, max_num_seqs=max(w.decode_batch, 1))
    reqs = lambda k: [Request(i, row, _params(b, k), seed=i) for i, row in enumerate(prompts.tolist())]  # noqa: E731

    def ours(num_new: int) -> tuple[float, float | None]:
        reset_peak(dev)
        _, s = timed(lambda: engine.generate(reqs(num_new)), dev)
        return s, peak_gib(dev)

    engine.generate(reqs(min(16, n)))                                            # warm-up: graphs captured
    our_s, our_peak = ours(n)
    print(f"[bench] decode: engine {our_s:.2f}s for {n} tokens", flush=True)
    engine.release()
    free_memory(dev)
    hf = build_hf_model(b.engine(), w.model, b.dtype, dev).eval()
    ids = prompts.to(dev)
    top_k = 0 if w.top_k == -1 else w.top_k   # 0: no top-k filter

    def hf_gen(num_new: int, max_time: float | None = None) -> int:
        """New tokens per row that HF produced (fewer than num_new only if max_time cut it)."""
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                              max_new_tokens=num_new, min_new_tokens=num_new, temperature=w.temperature,
                              top_p=w.top_p, top_k=top_k, pad_token_id=0, max_time=max_time)
        return out.shape[1] - ids.shape[1]

    try:
        probe = min(16, n)
        _, warm_s = timed(lambda: hf_gen(probe), dev)                          # warm-up and estimate
        estimate = warm_s / probe * n * 1.5    # later steps attend over longer caches
        hf_n, note = n, "same token count"
        if estimate > w.hf_max_seconds:
            hf_n = max(probe, min(n, int(w.hf_max_seconds / (warm_s / probe * 1.5)) // 16 * 16))
            note = (f"HF generate of {n} tokens estimated at {estimate:.0f}s > {w.hf_max_seconds:.0f}s: "
                    f"HF ran {hf_n} tokens; ratio compares the engine at {hf_n} tokens too")
        reset_peak(dev)
        planned = hf_n
        hf_n, hf_s = timed(lambda: hf_gen(planned, max_time=1.5 * w.hf_max_seconds), dev)
        hf_peak = peak_gib(dev)
        if hf_n < planned:
            note += f"; HF stopped by max_time after {hf_n} of {planned} tokens"
    finally:
        del hf
        free_memory(dev)
    at_hf_s = our_s
    if hf_n != n:
        engine.generate(reqs(min(16, hf_n)))
        at_hf_s = ours(hf_n)[0]
        engine.release()
    hf_rate, ours_rate = rate(w.decode_batch * hf_n, hf_s), rate(w.decode_batch * hf_n, at_hf_s)
    return DecodeResult(
        batch=w.decode_batch, prompt_len=w.decode_prompt_len, new_tokens=n, furlong_s=our_s,
        furlong_tok_per_s=rate(w.decode_batch * n, our_s), furlong_ms_per_step=1000 * our_s / n,
        furlong_peak_gib=our_peak, hf_new_tokens=hf_n,
        hf_s=hf_s, hf_tok_per_s=hf_rate, hf_peak_gib=hf_peak, furlong_at_hf_tokens_tok_per_s=ours_rate,
        furlong_over_hf=ours_rate / hf_rate, note=note)


def part_eval(b: Bench) -> EvalProbeResult:
    from furlong.engine import Request
    w, dev = b.w, b.device
    g = torch.Generator().manual_seed(b.seed + 4)
    lens = [w.prompt_lens[i % len(w.prompt_lens)] for i in range(w.eval_num_prompts)]
    prompts = [torch.randint(0, b.args.vocab_size, (p,), generator=g).tolist() for p in lens]
    engine = make_engine(b, max(lens) + w.eval_max_new_tokens)
    reqs = [Request(i, p, _params(b, w.eval_max_new_tokens, temperature=0.0)) for i, p in enumerate(prompts)]
    reset_peak(dev)
    outs, secs = timed(lambda: engine.generate(reqs), dev)
    stats = engine.reset_stats()
    kv_gib = engine.runner.kv_bytes / 2**30
    engine.release()
    num = sum(len(c.token_ids) for cs in outs for c in cs)
    return EvalProbeResult(num_prompts=len(prompts), max_new_tokens=w.eval_max_new_tokens, num_generated_tokens=num,
                           seconds=secs, tok_per_s=rate(num, secs), decode_steps=stats.num_decode_steps,
                           mean_running_batch=stats.mean_batch, num_preemptions=stats.num_preemptions,
                           peak_gib=peak_gib(dev), kv_cache_gib=kv_gib,
                           note="greedy, ignore_eos (random weights), fresh session: KV allocation and graph "
                                "captures included")
