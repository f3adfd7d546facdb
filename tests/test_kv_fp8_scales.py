"""Which fp8 KV scales keep the log-prob gap small: the measurement behind kv_fp8.py's choice.

A Qwen3-shaped model (head_dim 128, 4 layers; weights std 0.02, tied embedding std 0.1: logits of a
trained model's spread) given what trained models have and random init lacks: K channels that the
k-norm weight scales up (6 of 128 per layer, x4..x20) and V projections whose scale differs by layer
(x0.1 .. x8, a few rows x10). The unquantised engine samples continuations (T = 1); each scheme
then re-scores them with K and V quantised to e4m3 and dequantised (teacher-forced, so errors do
not compound through different tokens), against the unquantised forward:
    per token-head   scale = max|row| / 448 (what the engine stores)
    per layer-head   one scale per layer and KV head, from the prompt's absmax (later tokens clip)
    scale 1          no scaling (an uncalibrated per-tensor fp8 cache)
    bf16             K/V rounded to bf16: the floor the engine's bf16 cache has on the GPU
`pytest -s` prints the mean |log-prob gap| of each."""
from __future__ import annotations

import pytest
import torch

from furlong.engine import Engine, EngineConfig, Request, SamplingParams
from furlong.engine.forward import EngineForward
from furlong.engine.kv_fp8 import FP8, FP8_MAX, dequantize, quantize
from furlong.models.attention import packed_attention
from furlong.models.decoder import Transformer
from furlong.models.hf_config import ModelArgs

PROMPT, NEW = 64, 128
CONFIG = dict(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, head_dim=128, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
              tie_word_embeddings=True, model_type="qwen3")


def outlier_model() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelArgs.from_hf_config(CONFIG))
    m.init_weights(std=0.02)
    torch.nn.init.normal_(m.embed_tokens.weight, 0.0, 0.1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            w = torch.ones(128)
            w[torch.randperm(128, generator=g)[:6]] = torch.tensor([4.0, 8.0, 12.0, 16.0, 20.0, 6.0])
            a.k_norm.weight.copy_(w * (0.8 + 0.4 * torch.rand(128, generator=g)))
            a.v_proj.weight.mul_([0.1, 0.5, 2.0, 8.0][i])
            a.v_proj.weight[torch.randperm(a.v_proj.weight.shape[0], generator=g)[:8]] *= 10
    return m.eval()


def per_token_head(x, prompt_scale):
    return dequantize(*quantize(x), x.dtype)


def per_layer_head(x, prompt_scale):
    s = prompt_scale[None, :, None]                               # [1, Hkv, 1]
    return ((x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s).to(x.dtype)


def scale_one(x, prompt_scale):
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype)


def bf16(x, prompt_scale):
    return x.to(torch.bfloat16).to(x.dtype)


SCHEMES = {"per token-head": per_token_head, "per layer-head": per_layer_head, "scale 1": scale_one, "bf16": bf16}


def scored(fwd: EngineForward, ids: list[int], kv) -> torch.Tensor:
    """Log-probs [T-1, V] (fp64) of the sequence with attention over kv(k or v, prompt scale [Hkv])."""
    n = len(ids)
    cu = torch.tensor([0, n], dtype=torch.int32)

    def attend(layer, q, k, v):
        amax = lambda x: (x[:PROMPT].float().abs().amax(dim=(0, 2)) / FP8_MAX).clamp_min(1e-30)  # noqa: E731
        return packed_attention(q, kv(k, amax(k)), kv(v, amax(v)), cu, n)

    hidden = fwd.hidden(torch.tensor(ids), torch.arange(n), attend)
    return torch.log_softmax(fwd.logits(hidden[:-1]).double(), -1)


@pytest.mark.slow
@torch.no_grad()
def test_per_token_head_scales_keep_the_smallest_fp8_gap():
    model = outlier_model()

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return ""

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 2048, (PROMPT,), generator=g).tolist() for _ in range(3)]
    eng = Engine(model, Tok(), [], EngineConfig(page_size=16, decode_window=8, max_num_seqs=4, cpu_kv_tokens=2048,
                                                max_model_len=PROMPT + NEW))
    out = eng.generate([Request(i, p, SamplingParams(temperature=1.0, max_new_tokens=NEW, ignore_eos=True), seed=i)
                        for i, p in enumerate(prompts)])
    fwd = eng.runner.forward
    gaps = {name: [] for name in SCHEMES}
    for p, comps in zip(prompts, out):
        ids = p + comps[0].token_ids
        tgt = torch.tensor(comps[0].token_ids)[:, None]
        ref = scored(fwd, ids, lambda x, s: x)[PROMPT - 1:].gather(-1, tgt)[:, 0]
        for name, kv in SCHEMES.items():
            lp = scored(fwd, ids, kv)[PROMPT - 1:].gather(-1, tgt)[:, 0]
            gaps[name].append((lp - ref).abs().mean().item())
    mean = {name: sum(v) / len(v) for name, v in gaps.items()}
    print("mean |log-prob gap| to the unquantised model: " + ", ".join(f"{k} {v:.4f}" for k, v in mean.items()))
    assert mean["per token-head"] < min(mean["per layer-head"], mean["scale 1"])
    assert mean["bf16"] < mean["per token-head"]          # fp8 costs precision; bf16 is the floor
