"""LoRA adapters on the decoder's linear projections (Hu et al. 2021), with peft's semantics.

An adapted projection computes  y = W x + b + s * B A dropout(x),  s = alpha / rank, where
A [rank, in] and B [out, rank] are trainable fp32 parameters and W, b stay frozen. A starts
kaiming-uniform with a = sqrt(5) (nn.Linear's and peft's default), B at zero, so the adapted
model starts equal to the base; the draws come from a generator seeded by `LoraConfig.seed`
(--seed), in module order, so every rank and every resume builds the same adapters.

Every base parameter of the model is frozen (requires_grad False), embeddings, norms and LM head
included, as peft does: only A and B train. The base projection keeps its parameter names
(`layers.0.self_attn.q_proj.weight`), so HF I/O, weight sync and the engine see the plain
decoder's names; the adapters are `...q_proj.lora_A` / `...q_proj.lora_B`. Which projections are
adapted is decided by name (lora_names.py, which maps to HF's and peft's names); this file only
wraps the modules it is given.

`adapters_disabled(model)` switches every adapter off (the base model: the KL reference, with no
second copy of the weights); `merged_state_dict` / `merged_weight` fold s * B A into W for the
engine and for export.

Where this departs from peft: dropout is applied only when the module is training AND grad is
enabled (the trainer's no-grad log-prob passes run in train mode and must be deterministic; peft
follows `module.training` alone). The adapter path computes in the input's dtype (bf16 under the
trainer's FSDP mixed precision, whose all-gather casts A and B), where peft casts the input up to
the adapters' dtype (fp32); with fp32 compute (CPU) the two are the same function.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

ADAPTER_PARAMS = ("lora_A", "lora_B")


@dataclass(frozen=True)
class LoraConfig:
    """The adapters of a run (--lora-rank, --lora-alpha, --lora-dropout, --target-modules, --seed)."""
    rank: int                          # r >= 1
    alpha: float                       # scaling numerator: s = alpha / rank
    dropout: float                     # probability in [0, 1) on the adapter's input
    target_modules: tuple[str, ...]    # ("all-linear",) or module names, matched as peft does (lora_names.py)
    seed: int                          # seeds A's kaiming-uniform draws

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoraLinear(nn.Module):
    """A frozen nn.Linear's weight/bias (the same Parameter objects) plus A [r, in] and B [out, r] in fp32."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight          # [out, in]
        self.bias = base.bias              # [out] or None
        dev = base.weight.device
        self.lora_A = nn.Parameter(torch.zeros(rank, self.in_features, dtype=torch.float32, device=dev))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=torch.float32, device=dev))
        self.rank, self.scaling, self.dropout = rank, scaling, dropout
        self.adapters_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapters_enabled:
            return out
        if self.dropout > 0:
            x = F.dropout(x, self.dropout, training=self.training and torch.is_grad_enabled())
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        return out + F.linear(F.linear(x, a), b) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """s * B A [out, in] in fp32 (unsharded modules; weight_sync gathers sharded ones itself)."""
        return merged_delta(self.lora_A, self.lora_B, self.scaling)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scaling={self.scaling:g}"


def merged_delta(lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """s * B A in fp32: A [r, in], B [out, r] -> [out, in]."""
    return (lora_B.detach().float() @ lora_A.detach().float()) * scaling


def merged_weight(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + s * B A, added in fp32 and returned in W's dtype (full, unsharded tensors)."""
    return (weight.detach().float() + merged_delta(lora_A, lora_B, scaling)).to(weight.dtype)


def apply_lora(model: nn.Module, spec: LoraConfig, module_names: Iterable[str]) -> list[str]:
    """Replace each named nn.Linear of `model` by a LoraLinear, freeze every base parameter; returns the names.

    A's draws follow the order of `module_names` sorted as the model lists its modules, so the
    adapters do not depend on the order the caller gives them in.
    """
    if spec.rank < 1:
        raise ValueError(f"--lora-rank: must be >= 1 to add adapters, got {spec.rank}")
    if lora_modules(model):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    wanted = set(module_names)
    order = [n for n, _ in model.named_modules() if n in wanted]
    if set(order) != wanted:
        raise ValueError(f"apply_lora: no module {sorted(wanted - set(order))[0]!r} in the model")
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(spec.seed)
    for name in order:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, attr)
        if not isinstance(base, nn.Linear):
            raise ValueError(f"apply_lora: {name} is a {type(base).__name__}, not a Linear layer")
        mod = LoraLinear(base, spec.rank, spec.scaling, spec.dropout)
        if mod.lora_A.device.type != "meta":
            a = torch.empty(mod.lora_A.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)   # drawn on the CPU: the same on any device
            with torch.no_grad():
                mod.lora_A.copy_(a)
        setattr(parent, attr, mod)
    return order


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """Module name -> adapted projection (empty for a model without adapters)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoraLinear) for m in model.modules())


def is_adapter_param(name: str) -> bool:
    """True for an adapter parameter's name ("layers.0.mlp.up_proj.lora_A")."""
    return name.rpartition(".")[2] in ADAPTER_PARAMS


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only, by our names ("layers.0.self_attn.q_proj.lora_A" -> [r, in])."""
    return {n: p for n, p in model.named_parameters() if is_adapter_param(n)}


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain decoder's state dict with every adapter folded into its weight (unsharded models)."""
    mods = lora_modules(model)
    out = {}
    for name, t in model.state_dict().items():
        if is_adapter_param(name):
            continue
        owner, _, leaf = name.rpartition(".")
        if leaf == "weight" and owner in mods:
            m = mods[owner]
            t = merged_weight(t, m.lora_A, m.lora_B, m.scaling)
        out[name] = t
    return out


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base model (every adapter off) inside the block."""
    mods = list(lora_modules(model).values())
    before = [m.adapters_enabled for m in mods]
    for m in mods:
        m.adapters_enabled = False
    try:
        yield
    finally:
        for m, on in zip(mods, before):
            m.adapters_enabled = on
