"""Bench parts that generate: `rollout` (the step's responses) and the `decode` probe.

  rollout  the engine generates the responses with ignore_eos. Deviation: the
           Generator takes one max_new_tokens per call, so all samples decode
           together for max(response_lens) steps and are cut to their forced
           lengths. That is also what a real step costs: a static batch runs
           until its longest response ends. tok/s counts the forced tokens.
  decode   the decode probe (B x P prompt, exactly N new tokens) on the engine and
           on transformers `generate` (same weights, sampling, sdpa). If HF's
           warm-up predicts more than `hf_max_seconds` (default 60) for N tokens,
           HF runs fewer tokens and the engine is re-run at that count for the ratio.
"""
from __future__ import annotations

import torch

from furlong.bench.measure import free_memory, peak_gib, rate, reset_peak, timed
from furlong.bench.report import DecodeResult, RolloutResult
from furlong.bench.state import Bench, NullTokenizer, build_hf_model


def _generator(b: Bench, batch: int):
    from furlong.rollout.generator import Generator
    return Generator(b.engine(), NullTokenizer(), eos_token_ids=[], max_batch_size=batch, device=b.device)


def _sampling(b: Bench, new_tokens: int, seed: int = 0):
    from furlong.rollout.sampling import SamplingParams
    return SamplingParams(temperature=b.w.temperature, top_p=b.w.top_p, top_k=b.w.top_k,
                          max_new_tokens=new_tokens, ignore_eos=True, seed=seed)


def part_rollout(b: Bench) -> RolloutResult:
    w, dev = b.w, b.device
    g = torch.Generator().manual_seed(b.seed + 2)
    prompts = [torch.randint(0, b.args.vocab_size, (p,), generator=g).tolist() for p in w.prompt_lens]
    batch = [prompts[i // w.n_samples_per_prompt] for i in range(w.num_samples)]
    gen, max_new = _generator(b, w.num_samples), max(w.response_lens)
    gen.generate(batch, _sampling(b, min(8, max_new)))                           # warm-up
    reset_peak(dev)
    outs, secs = timed(lambda: gen.generate(batch, _sampling(b, max_new)), dev)
    short = [i for i, (o, r) in enumerate(zip(outs, w.response_lens)) if len(o.token_ids) < r]
    if short:
        raise RuntimeError(f"engine stopped early on {len(short)} samples despite ignore_eos (first: {short[0]})")
    forced = sum(len(o.token_ids[:r]) for o, r in zip(outs, w.response_lens))
    return RolloutResult(
        num_samples=w.num_samples, max_new_tokens=max_new, num_forced_tokens=forced, seconds=secs,
        tok_per_s=rate(forced, secs), decoded_slots_per_s=rate(w.num_samples * max_new, secs),
        peak_gib=peak_gib(dev),
        note="one generate call at max(response_lens) with ignore_eos, responses cut to their forced lengths")


def part_decode(b: Bench) -> DecodeResult:
    w, dev = b.w, b.device
    g = torch.Generator().manual_seed(b.seed + 3)
    prompts = torch.randint(0, b.args.vocab_size, (w.decode_batch, w.decode_prompt_len), generator=g)
    gen, n = _generator(b, w.decode_batch), w.decode_new_tokens

    def ours(num_new: int) -> tuple[float, float | None]:
        reset_peak(dev)
        _, s = timed(lambda: gen.generate(prompts.tolist(), _sampling(b, num_new)), dev)
        return s, peak_gib(dev)

    gen.generate(prompts.tolist(), _sampling(b, min(8, n)))                      # warm-up
    our_s, our_peak = ours(n)
    print(f"[bench] decode: engine {our_s:.2f}s for {n} tokens", flush=True)
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
        # Later steps attend over longer caches: assume 1.5x the warm-up's time per token.
        estimate = warm_s / probe * n * 1.5
        hf_n, note = n, "same token count"
        if estimate > w.hf_max_seconds:
            hf_n = max(probe, min(n, int(w.hf_max_seconds / (warm_s / probe * 1.5)) // 16 * 16))
            note = (f"HF generate of {n} tokens estimated at {estimate:.0f}s > {w.hf_max_seconds:.0f}s: "
                    f"HF ran {hf_n} tokens; ratio compares the engine at {hf_n} tokens too")
        reset_peak(dev)
        # max_time: a hard stop in case the estimate was optimistic; tok/s uses what was produced
        planned = hf_n
        hf_n, hf_s = timed(lambda: hf_gen(planned, max_time=1.5 * w.hf_max_seconds), dev)
        hf_peak = peak_gib(dev)
        if hf_n < planned:
            note += f"; HF stopped by max_time after {hf_n} of {planned} tokens"
    finally:
        del hf
        free_memory(dev)
    at_hf_s = our_s if hf_n == n else ours(hf_n)[0]
    hf_rate, ours_rate = rate(w.decode_batch * hf_n, hf_s), rate(w.decode_batch * hf_n, at_hf_s)
    return DecodeResult(
        batch=w.decode_batch, prompt_len=w.decode_prompt_len, new_tokens=n, furlong_s=our_s,
        furlong_tok_per_s=rate(w.decode_batch * n, our_s), furlong_peak_gib=our_peak, hf_new_tokens=hf_n,
        hf_s=hf_s, hf_tok_per_s=hf_rate, hf_peak_gib=hf_peak, furlong_at_hf_tokens_tok_per_s=ours_rate,
        furlong_over_hf=ours_rate / hf_rate, note=note)
