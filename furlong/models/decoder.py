"""The decoder-only transformer of the Llama / Qwen2 / Qwen3 families.

pre-norm blocks: x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x)); final RMSNorm;
output projection (the embedding matrix when tied). Attention is GQA with RoPE
(fp32, the checkpoint's theta and scaling), optional q/k/v/o biases and Qwen3's qk-norm.
RMSNorm computes in fp32 and casts back before the weight, as transformers does.

Two ways in, one layer stack:
  forward / hidden_states  [B, T] rows, optional left/right padding mask
  forward_packed           one packed row of N samples (cu_seqlens), see attention.py
Each DecoderLayer is self-contained (FSDP shards each one). The rollout engine
runs its own token-major forward over these modules' weights with a paged KV
cache (engine/forward.py); tests hold the two to the same function.
HF parameter names are mapped in hf_io.py, not here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from furlong.models.attention import PackedAttnFn, packed_attention_fn
from furlong.models.hf_config import ModelArgs
from furlong.models.rope import apply_rope, rope_attention_factor, rope_cos_sin, rope_inv_freq


@dataclass
class AttnInputs:
    """How the layers' attention should mix positions; exactly one mode is used."""
    mask: torch.Tensor | None = None        # [B, 1, T, T] bool, True = attend (None: causal)
    cu_seqlens: torch.Tensor | None = None  # [N+1] int32, packed mode when set
    max_seqlen: int = 0                     # longest packed sample
    packed_attn: PackedAttnFn | None = None  # packed mode's kernel, picked once per forward (attention.py)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        h, d = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=args.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=args.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=args.o_bias)
        self.q_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed hidden h [B, T, H] -> q [B, T, Hq, D], k and v [B, T, Hkv, D] (q, k normed and roped)."""
        b, t, _ = h.shape
        q = self.q_proj(h).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(h).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnInputs) -> torch.Tensor:
        """Attention core: q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq * D] (before o_proj)."""
        b, t = q.shape[:2]
        if ctx.cu_seqlens is not None:   # packed: b == 1
            if t == 0:
                return q.new_zeros(b, t, self.num_heads * self.head_dim)
            # squeeze, not q[0]: a select's backward writes the gradient into a new zero-filled
            # tensor (a fill and a copy of q, k and v per layer and micro-batch); a view's does not
            out = ctx.packed_attn(q.squeeze(0), k.squeeze(0), v.squeeze(0), ctx.cu_seqlens, ctx.max_seqlen,
                                  self.head_dim ** -0.5)
            return out.reshape(b, t, self.num_heads * self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # [B, H, T, D]
        mask = ctx.mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnInputs) -> torch.Tensor:
        return self.o_proj(self.attend(*self.project(h, cos, sin), ctx))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        h, i = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=args.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=args.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnInputs) -> torch.Tensor:
        """x [B, T, H] -> next x [B, T, H]; cos/sin [B, T, D] fp32."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # Non-persistent: never in a checkpoint; recomputed in fp32 after every move/cast (_apply).
        self.register_buffer("inv_freq", rope_inv_freq(args.head_dim, args.rope_theta, scaling=args.rope_scaling),
                             persistent=False)
        self.rope_attention_factor = rope_attention_factor(args.rope_scaling)   # cos/sin multiplier (YaRN)
        self.gradient_checkpointing = False
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        """Random init for models not loaded from a checkpoint (no-op on the meta device)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def init_rope(self) -> None:
        """(Re)compute the fp32 RoPE frequencies on the buffer's device."""
        device = self.inv_freq.device
        if device.type != "meta":
            self.inv_freq = rope_inv_freq(self.args.head_dim, self.args.rope_theta, device=device,
                                          scaling=self.args.rope_scaling)

    def _apply(self, fn, recurse=True):
        # .to(bf16) / to_empty would otherwise cast or blank the fp32 frequencies.
        super()._apply(fn, recurse)
        self.init_rope()
        return self

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, H] output projection (the embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _run_layers(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: AttnInputs) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if ctx.cu_seqlens is not None:
            ctx = dataclasses.replace(ctx, packed_attn=packed_attention_fn(x))
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, self.rope_attention_factor)
        ckpt = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            x = checkpoint(layer, x, cos, sin, ctx, use_reentrant=False) if ckpt else layer(x, cos, sin, ctx)
        return self.norm(x)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final-normed hidden [B, T, H].

        attention_mask [B, T] (1 real, 0 pad) masks pad keys; pad queries attend only
        to themselves (finite garbage, ignore them). position_ids default to
        arange(T), or cumsum(mask) - 1 clamped at 0 under a mask.
        """
        b, t = input_ids.shape
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            else:
                position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        mask = None
        if attention_mask is not None:
            keep = attention_mask.bool()
            causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
            eye = torch.eye(t, dtype=torch.bool, device=input_ids.device)
            mask = ((causal & keep[:, None, :]) | eye)[:, None]   # [B, 1, T, T]
        return self._run_layers(input_ids, position_ids, AttnInputs(mask=mask))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] in the model dtype."""
        hidden = self.hidden_states(input_ids, position_ids, attention_mask)
        return F.linear(hidden, self.output_weight)

    def forward_packed(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """One packed row: input_ids/position_ids [T], cu_seqlens [N+1] int32 -> hidden [T, H].

        No logits here: callers project chunks of the hidden states themselves.
        """
        ctx = AttnInputs(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return self._run_layers(input_ids[None], position_ids[None], ctx).squeeze(0)   # a view (see attend)
