"""furlong's train-step kernels beside liger-kernel's where they apply (device; liger's wheel in .whl).

On the seed step's first micro-batch (its samples in order up to 32768 tokens, Qwen3-0.6B shape, bf16):
  lmhead  the LM head and a GRPO loss (PPO clip 0.2/0.28, token mean, no KL), forward and backward,
          over the response positions: furlong's `chunked_log_probs` on the packed positions (with
          entropy, as the actor computes it; logits kept for backward within the actor's budget, and
          recomputed) against liger's `LigerFusedLinearGRPOLoss` (loss_type "bnpo", the token mean),
          which takes a padded [B, T_resp_max] batch. Median ms of 5, peak memory, and the two
          losses' and gradients' largest differences.
  layer   one decoder layer, forward and backward over the micro-batch: furlong's compiled layer
          (trainer/fsdp.py: compile_layers) against the same weights run eagerly with liger's RMSNorm,
          RoPE and SwiGLU kernels around the same projections and flash attention.

    python3 bench/liger_compare.py [--parts lmhead,layer] [--out DIR]   -> DIR/liger_compare.json
    python3 bench/liger_compare.py --tiny     # CPU smoke check of the lmhead part: tiny fp32 shapes
liger-kernel is not a furlong dependency: `pip download liger-kernel --no-deps -d .whl` on a machine
with network, then carry .whl; bench/device_run.sh installs it into /tmp/site (PYTHONPATH).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch

from furlong.bench.measure import median_ms, peak_gib, reset_peak
from furlong.bench.workload import load_workload
from furlong.trainer.logprobs import chunked_log_probs, keep_logits_budget

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _time_ms(fn: Callable[[], None], device: torch.device, n: int = 5) -> tuple[float, float]:
    """(median ms of n calls after a warm-up, peak GiB above what was allocated before; 0 on CPU)."""
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    reset_peak(device)
    ms = median_ms(fn, device, n)
    peak = peak_gib(device)
    return ms, 0.0 if peak is None else peak - base / 2**30


def part_lmhead(device: torch.device, dtype: torch.dtype, samples: list[tuple[int, int]], hidden_size: int,
                vocab: int) -> dict:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    g = torch.Generator(device=device).manual_seed(0)
    resp = [r for _, r in samples]
    num_resp, batch, t_max = sum(resp), len(resp), max(resp)
    hidden = torch.randn(num_resp, hidden_size, device=device, dtype=dtype, generator=g)
    weight = (0.02 * torch.randn(vocab, hidden_size, device=device, generator=g)).to(dtype)
    targets = torch.randint(0, vocab, (num_resp,), device=device, generator=g)
    sample_adv = torch.randn(batch, device=device, generator=g)
    lengths = torch.tensor(resp, device=device)
    adv = sample_adv.repeat_interleave(lengths)                                  # [R]
    with torch.no_grad():
        logp0, _ = chunked_log_probs(hidden, weight, targets)
    old = logp0 + 0.1 * torch.randn(num_resp, device=device, generator=g)        # ratios off 1: clipping active
    # padded layout for liger: row b holds sample b's response positions, left-aligned
    row = torch.arange(batch, device=device).repeat_interleave(lengths)
    col = torch.arange(num_resp, device=device) - (torch.cumsum(lengths, 0) - lengths).repeat_interleave(lengths)
    mask = torch.zeros(batch, t_max, device=device)
    mask[row, col] = 1.0
    pad = lambda x, fill=0: torch.full((batch, t_max) + x.shape[1:], fill, dtype=x.dtype,  # noqa: E731
                                       device=device).index_put_((row, col), x)
    hidden_pad, targets_pad, old_pad = pad(hidden), pad(targets), pad(old)
    liger_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="bnpo", epsilon_low=EPS_LOW,
                                        epsilon_high=EPS_HIGH, compiled=device.type == "cuda")

    def ours(keep: int):
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        logp, _ = chunked_log_probs(h, w, targets, 1.0, 4096, True, keep_logits_bytes=keep)
        ratio = torch.exp(logp - old)
        loss = -torch.min(ratio * adv, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * adv).sum() / num_resp
        loss.backward()
        return loss.detach(), h.grad, w.grad

    def liger():
        h, w = hidden_pad.detach().requires_grad_(), weight.detach().requires_grad_()
        out = liger_fn(h, w, targets_pad, mask, sample_adv, old_per_token_logps=old_pad)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        return loss.detach(), h.grad[row, col], w.grad

    def liger_tf32():
        # liger's backward runs its GEMMs in fp32 (grad_logits @ weight.float()); TF32 is off by default in
        # torch, and a user who turns it on gets this figure
        old_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return liger()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old_tf32

    keep = keep_logits_budget(device)
    ref = ours(keep)
    res = {"num_samples": batch, "num_response_tokens": num_resp, "padded_tokens": batch * t_max, "vocab": vocab}
    for name, fn in (("furlong_kept_logits", lambda: ours(keep)), ("furlong_recomputed", lambda: ours(0)),
                     ("liger_grpo", liger), ("liger_grpo_tf32", liger_tf32)):
        loss, gh, gw = fn()
        ms, gib = _time_ms(fn, device)
        res[name] = {"ms": ms, "peak_gib": gib, "loss": float(loss),
                     "max_abs_loss_diff": abs(float(loss) - float(ref[0])),
                     "max_rel_grad_hidden_diff": float((gh.float() - ref[1].float()).abs().max()
                                                       / ref[1].float().abs().max()),
                     "max_rel_grad_weight_diff": float((gw.float() - ref[2].float()).abs().max()
                                                       / ref[2].float().abs().max())}
        print(f"[liger_compare] lmhead {name}: {res[name]}", flush=True)
    return res


def part_layer(device: torch.device, samples: list[tuple[int, int]]) -> dict:
    from liger_kernel.transformers.functional import liger_rms_norm, liger_rope, liger_swiglu

    from furlong.models.attention import packed_attention_fn
    from furlong.models.decoder import AttnInputs, DecoderLayer
    from furlong.models.hf_config import ModelArgs
    from furlong.models.rope import rope_cos_sin, rope_inv_freq
    w = load_workload(Path(__file__).with_name("seed_workload.json"))
    args = ModelArgs.from_hf_config(w.model, source="workload model")
    torch.manual_seed(0)
    layer = DecoderLayer(args, 0).to(device=device, dtype=torch.bfloat16)
    for m in layer.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, 0.0, 0.02)
    lens = [p + r for p, r in samples]
    num_tokens = sum(lens)
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n, device=device) for n in lens])[None]
    cos, sin = rope_cos_sin(pos, rope_inv_freq(args.head_dim, args.rope_theta, device=device))
    x0 = torch.randn(1, num_tokens, args.hidden_size, device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x0)
    attn = packed_attention_fn(x0)
    ctx = AttnInputs(cu_seqlens=cu, max_seqlen=max(lens), packed_attn=attn)
    compiled = torch.compile(layer.forward, dynamic=True)
    eps, a, d = args.rms_norm_eps, layer.self_attn, args.head_dim
    cos_b, sin_b = cos.to(torch.bfloat16), sin.to(torch.bfloat16)

    def liger_forward(x):
        t = x.shape[1]
        h = liger_rms_norm(x, layer.input_layernorm.weight, eps, in_place=False)
        q = liger_rms_norm(a.q_proj(h).view(1, t, a.num_heads, d), a.q_norm.weight, eps, in_place=False)
        k = liger_rms_norm(a.k_proj(h).view(1, t, a.num_kv_heads, d), a.k_norm.weight, eps, in_place=False)
        v = a.v_proj(h).view(1, t, a.num_kv_heads, d)
        q, k = liger_rope(q.transpose(1, 2), k.transpose(1, 2), cos_b, sin_b)   # [1, H, T, D]
        o = attn(q.transpose(1, 2)[0], k.transpose(1, 2)[0], v[0], cu, max(lens), d ** -0.5)
        x = x + a.o_proj(o.reshape(1, t, -1))
        h = liger_rms_norm(x, layer.post_attention_layernorm.weight, eps, in_place=False)
        return x + layer.mlp.down_proj(liger_swiglu(layer.mlp.gate_proj(h), layer.mlp.up_proj(h)))

    def run(f):
        def step():
            x = x0.detach().requires_grad_()
            out = f(x) if f is liger_forward else f(x, cos, sin, ctx)
            out.backward(grad)
            return out.detach(), x.grad
        return step

    res = {"num_tokens": num_tokens}
    ref_out, ref_grad = run(compiled)()
    for name, f in (("furlong_compiled", compiled), ("liger_eager", liger_forward)):
        out, gx = run(f)()
        ms, gib = _time_ms(run(f), device)
        res[name] = {"ms": ms, "peak_gib": gib, "max_abs_out_diff": float((out.float() - ref_out.float()).abs().max()),
                     "max_abs_grad_x_diff": float((gx.float() - ref_grad.float()).abs().max())}
        print(f"[liger_compare] layer {name}: {res[name]}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="lmhead,layer")
    ap.add_argument("--out", default=".")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke check of the lmhead part (fp32, tiny shapes)")
    a = ap.parse_args()
    from importlib.metadata import version
    res: dict = {"torch": torch.__version__, "liger_kernel": version("liger_kernel")}
    if a.tiny:
        res["lmhead"] = part_lmhead(torch.device("cpu"), torch.float32, [(3, 5), (2, 9), (4, 1), (2, 7)], 32, 97)
    else:
        device = torch.device("cuda")
        samples = load_workload(Path(__file__).with_name("seed_workload.json")).first_micro_batch(32768)
        for part in a.parts.split(","):
            if part == "lmhead":
                res["lmhead"] = part_lmhead(device, torch.bfloat16, samples, 1024, 151936)
            elif part == "layer":
                res["layer"] = part_layer(device, samples)
            else:
                ap.error(f"--parts: unknown part {part!r} (lmhead, layer)")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "liger_compare.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
