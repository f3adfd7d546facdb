"""The engine's forward over the model's own weights: fused projections, compiled layer blocks.

Token-major, with per-layer blocks compiled once for all layers.

Tokens are rows ([N, ...]: the packed tokens of a prefill or one token per
sequence in a decode step). A layer is
    q, k, v = pre_attention(x)      RMSNorm, one QKV matmul, qk-norm, RoPE
    o = attend(layer, q, k, v)      the KV-cache context (kv_cache.py)
or, in a decode step on CUDA, with qk-norm, RoPE and the KV store in one kernel:
    qkv = project_qkv(x)            RMSNorm, one QKV matmul
    o = attend_qkv(layer, qkv, ..)  store_kernels.decode_prologue, then the attention
    x = post_attention(x, o)        o-projection + residual, RMSNorm, one gate|up matmul, SiLU*up, down + residual
with the same arithmetic as models/decoder.py (RMSNorm and RoPE in fp32, cast
back before the weight; each projection rounded to the model dtype before its
residual add) so the engine and the trainer compute the same function; tests
compare the two.

Layer boundaries: a layer's post_attention and the next layer's pre_attention
(or project_qkv; the final norm after the last layer) are one function, so the
compiler fuses the down projection's residual add into the next RMSNorm's
kernel. Compiled alone, post_attention returned `x + down(..)`, which the
compiler turns into cuBLAS addmm: a copy of x into the output, then the matmul
accumulating onto it (two per layer with the o-projection's), one rounding
where the trainer rounds twice. `add_residual` adds in fp32 on the rounded
projection, which keeps it a pointwise add (the trainer's rounding, the same
bits as a bf16 add). Measured: 362 -> 306 kernels a decode step, 1.032x on
the fp8 decode probe (BENCHMARKS.md).

Fused weights: `fuse_projections` concatenates each layer's q/k/v (and gate/up)
weights and biases into one tensor and turns the module's parameters into views
of it. The parameters keep their names and shapes, so weight sync (`copy_` by
name) writes straight into the fused tensors, and CUDA graphs captured over
them stay valid. Given a WeightArena (--offload-rollout-level weight), every
weight is placed in it, so its memory can be given back during training.

Compilation (CUDA): the first layer's pre_attention/project_qkv and the three
boundary functions are each `torch.compile`d once with a dynamic token count;
every layer calls the same compiled code with its own weights (tensors passed
one by one: no per-layer recompiles), fusing the norms, RoPE, SiLU and residual
adds into a few kernels. The matmuls stay cuBLAS.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from furlong.engine.weight_arena import WeightArena
from furlong.models.rope import rope_cos_sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; cos/sin [N, D] fp32 (rotate-half, as models/rope.py)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def pre_attention(x: torch.Tensor, ln_w: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None,
                  qn_w: torch.Tensor | None, kn_w: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                  eps: float, num_heads: int, num_kv_heads: int, head_dim: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] -> q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D] (q, k roped)."""
    n = x.shape[0]
    qkv = F.linear(rms_norm(x, ln_w, eps), qkv_w, qkv_b)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(n, num_heads, head_dim), k.view(n, num_kv_heads, head_dim), v.reshape(n, num_kv_heads, head_dim)
    if qn_w is not None:
        q, k = rms_norm(q, qn_w, eps), rms_norm(k, kn_w, eps)
    return rope(q, cos, sin), rope(k, cos, sin), v


def project_qkv(x: torch.Tensor, ln_w: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None,
                eps: float) -> torch.Tensor:
    """x [N, H] -> the fused q|k|v projection [N, (Hq + 2 Hkv) D], before qk-norm and RoPE (the decode
    prologue kernel, store_kernels.decode_prologue, applies those)."""
    return F.linear(rms_norm(x, ln_w, eps), qkv_w, qkv_b)


def add_residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y, both [N, H] in the model dtype, rounded once: the same bits as `x + y` in bf16/fp16. Written
    in fp32 so the compiler cannot fold it into the matmul that made y (addmm: see the module docstring)."""
    return (x.float() + y.float()).to(x.dtype)


def post_attention(x: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None,
                   ln_w: torch.Tensor, gu_w: torch.Tensor, gu_b: torch.Tensor | None, down_w: torch.Tensor,
                   down_b: torch.Tensor | None, eps: float, intermediate: int) -> torch.Tensor:
    """x [N, H], o [N, Hq, D] -> next x [N, H]."""
    x = add_residual(x, F.linear(o.flatten(1), o_w, o_b))
    gate, up = F.linear(rms_norm(x, ln_w, eps), gu_w, gu_b).split(intermediate, dim=-1)
    return add_residual(x, F.linear(F.silu(gate) * up, down_w, down_b))


def post_then_pre(x: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None,
                  post_ln_w: torch.Tensor, gu_w: torch.Tensor, gu_b: torch.Tensor | None, down_w: torch.Tensor,
                  down_b: torch.Tensor | None, eps: float, intermediate: int, ln_w: torch.Tensor,
                  qkv_w: torch.Tensor, qkv_b: torch.Tensor | None, qn_w: torch.Tensor | None,
                  kn_w: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                  num_kv_heads: int, head_dim: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's post_attention, then the next layer's pre_attention: -> x [N, H], q, k, v."""
    x = post_attention(x, o, o_w, o_b, post_ln_w, gu_w, gu_b, down_w, down_b, eps, intermediate)
    return (x, *pre_attention(x, ln_w, qkv_w, qkv_b, qn_w, kn_w, cos, sin, eps, num_heads, num_kv_heads,
                              head_dim))


def post_then_project(x: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None,
                      post_ln_w: torch.Tensor, gu_w: torch.Tensor, gu_b: torch.Tensor | None,
                      down_w: torch.Tensor, down_b: torch.Tensor | None, eps: float, intermediate: int,
                      ln_w: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's post_attention, then the next layer's project_qkv: -> x [N, H], qkv."""
    x = post_attention(x, o, o_w, o_b, post_ln_w, gu_w, gu_b, down_w, down_b, eps, intermediate)
    return x, project_qkv(x, ln_w, qkv_w, qkv_b, eps)


def post_then_norm(x: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None,
                   post_ln_w: torch.Tensor, gu_w: torch.Tensor, gu_b: torch.Tensor | None, down_w: torch.Tensor,
                   down_b: torch.Tensor | None, eps: float, intermediate: int, norm_w: torch.Tensor
                   ) -> torch.Tensor:
    """The last layer's post_attention, then the final RMSNorm: -> hidden [N, H]."""
    return rms_norm(post_attention(x, o, o_w, o_b, post_ln_w, gu_w, gu_b, down_w, down_b, eps, intermediate),
                    norm_w, eps)


def _fuse(params: list[nn.Parameter], arena: WeightArena | None) -> torch.Tensor:
    """Concatenate along dim 0 into one tensor (in `arena` when given); each parameter becomes a view of
    its slice."""
    shape = (sum(p.shape[0] for p in params), *params[0].shape[1:])
    out = None if arena is None else arena.take(shape, params[0].dtype)
    fused = torch.cat([p.detach() for p in params], dim=0, out=out)
    start = 0
    for p in params:
        p.data = fused[start:start + p.shape[0]]
        start += p.shape[0]
    return fused


@dataclass
class LayerWeights:
    ln_w: torch.Tensor
    qkv_w: torch.Tensor                   # [(Hq + 2 Hkv) D, H], q_proj/k_proj/v_proj.weight are views
    qkv_b: torch.Tensor | None
    qn_w: torch.Tensor | None
    kn_w: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    post_ln_w: torch.Tensor
    gu_w: torch.Tensor                    # [2 I, H], gate_proj/up_proj.weight are views
    gu_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


def fuse_projections(model: nn.Module, arena: WeightArena | None = None) -> list[LayerWeights]:
    """Each layer's q/k/v and gate/up weights (and biases) fused. With `arena`, every parameter of the
    model ends up in it (the fused tensors made there, the rest copied in), so that its memory can be
    released during training (weight_arena.py)."""
    out = []
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        fuse = lambda *mods, kind="weight": (  # noqa: E731
            _fuse([getattr(x, kind) for x in mods], arena) if getattr(mods[0], kind) is not None else None)
        out.append(LayerWeights(
            ln_w=layer.input_layernorm.weight,
            qkv_w=fuse(a.q_proj, a.k_proj, a.v_proj), qkv_b=fuse(a.q_proj, a.k_proj, a.v_proj, kind="bias"),
            qn_w=a.q_norm.weight if a.q_norm is not None else None,
            kn_w=a.k_norm.weight if a.k_norm is not None else None,
            o_w=a.o_proj.weight, o_b=a.o_proj.bias, post_ln_w=layer.post_attention_layernorm.weight,
            gu_w=fuse(m.gate_proj, m.up_proj), gu_b=fuse(m.gate_proj, m.up_proj, kind="bias"),
            down_w=m.down_proj.weight, down_b=m.down_proj.bias))
    if arena is not None:
        for p in model.parameters():
            if not arena.holds(p):
                p.data = arena.take(tuple(p.shape), p.dtype).copy_(p.detach())
    return out


class EngineForward:
    def __init__(self, model: nn.Module, compile: bool, arena: WeightArena | None = None):
        """`arena`: where the weights are to live (weight_arena.py); None leaves them where they are."""
        self.model = model
        self.args = model.args
        self.layers = fuse_projections(model, arena)
        fns = pre_attention, project_qkv, post_then_pre, post_then_project, post_then_norm
        if compile:
            fns = tuple(torch.compile(f, dynamic=True) for f in fns)
        self.pre, self.project, self.post_pre, self.post_project, self.post_norm = fns

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
               attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
               attend_qkv: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions [N] -> final-normed hidden [N, H]; attend(layer, q, k, v) -> [N, Hq, D].
        attend_qkv(layer, qkv, q_norm, k_norm, cos, sin, eps) -> [N, Hq, D], when given, takes the
        projection before qk-norm and RoPE and applies them itself (DecodeContext.attend_qkv)."""
        a, m, eps = self.args, self.model, self.args.rms_norm_eps
        heads = a.num_heads, a.num_kv_heads, a.head_dim
        x = m.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, m.inv_freq, m.rope_attention_factor)
        w = self.layers[0]
        if attend_qkv is not None:
            qkv = self.project(x, w.ln_w, w.qkv_w, w.qkv_b, eps)
        else:
            q, k, v = self.pre(x, w.ln_w, w.qkv_w, w.qkv_b, w.qn_w, w.kn_w, cos, sin, eps, *heads)
        for i, w in enumerate(self.layers):
            if attend_qkv is not None:
                o = attend_qkv(i, qkv, w.qn_w, w.kn_w, cos, sin, eps)
            else:
                o = attend(i, q, k, v)
            post = (x, o, w.o_w, w.o_b, w.post_ln_w, w.gu_w, w.gu_b, w.down_w, w.down_b, eps, a.intermediate_size)
            if i + 1 < len(self.layers):
                n = self.layers[i + 1]
                if attend_qkv is not None:
                    x, qkv = self.post_project(*post, n.ln_w, n.qkv_w, n.qkv_b)
                else:
                    x, q, k, v = self.post_pre(*post, n.ln_w, n.qkv_w, n.qkv_b, n.qn_w, n.kn_w, cos, sin, *heads)
        return self.post_norm(*post, m.norm.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.output_weight)
