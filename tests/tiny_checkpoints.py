"""Tiny random HF checkpoints and a character-level ChatML tokenizer, for tests.

The checkpoint is written by transformers itself (Qwen3/Qwen2/LlamaForCausalLM,
fp32), so loading it checks our reader against the real format. Norm weights
and biases are randomized too (transformers inits them to 1 and 0), so a
missing bias or norm cannot go unnoticed.

The tokenizer maps each printable ASCII character, newline and tab to one token
(a BPE model with no merges), plus the special tokens <|endoftext|> (pad),
<|im_start|>, <|im_end|> (eos) and <unk>; decoding concatenates, so
decode(encode(s)) == s for ASCII text.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHARS = [chr(i) for i in range(32, 127)] + ["\n", "\t"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZER_SIZE = len(SPECIAL_TOKENS) + len(CHARS)   # 101


def build_tokenizer():
    """A transformers PreTrainedTokenizerFast over the character vocabulary above."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _hf_config(family: str, **kw):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if family not in classes:
        raise ValueError(f"family {family!r} unknown (choose from {sorted(classes)})")
    if family == "qwen2":
        kw.pop("attention_bias")   # qwen2 always has q/k/v bias
    return classes[family](**kw)


def write_tiny_checkpoint(out_dir: str | Path, family: str = "qwen3", vocab_size: int = 128, hidden: int = 64,
                          layers: int = 2, heads: int = 4, kv_heads: int = 2, tie: bool = True, seed: int = 0,
                          num_shards: int = 1, with_tokenizer: bool = True, intermediate: int | None = None,
                          attention_bias: bool = False, rope_theta: float = 10000.0,
                          init_std: float = 0.1, max_position_embeddings: int = 512,
                          rope_scaling: dict | None = None) -> Path:
    """Write a random fp32 HF checkpoint (+ tokenizer) into out_dir and return it.

    rope_scaling: extra rope_parameters fields, e.g. {"rope_type": "llama3", "factor": 8.0, ...}.

    num_shards > 1 writes model-0000k-of-0000n.safetensors shards plus the index json.
    """
    from transformers import AutoModelForCausalLM

    if vocab_size < TOKENIZER_SIZE and with_tokenizer:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {TOKENIZER_SIZE}")
    out_dir = Path(out_dir)
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    config = _hf_config(
        family, vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, attention_bias=attention_bias, initializer_range=init_std,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
        bos_token_id=None, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    kwargs = {}
    if num_shards > 1:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        kwargs["max_shard_size"] = math.ceil(total / num_shards)
    model.save_pretrained(out_dir, **kwargs)
    if with_tokenizer:
        build_tokenizer().save_pretrained(out_dir)
    return out_dir
