"""LoRA names: which projections --target-modules selects, and the adapters' names in peft's files.

Targets are matched on HF module names (our module name with HF's "model." prefix, through
hf_io.hf_name, the one mapping), as peft matches them:
  - "all-linear": every Linear layer of the decoder blocks, i.e. q/k/v/o_proj and
    gate/up/down_proj; never the LM head (peft excludes the output embedding);
  - otherwise a comma-separated list; an entry selects a module whose HF name equals it or
    ends with "." + entry ("q_proj", "self_attn.o_proj", "model.layers.0.mlp.up_proj"). As in
    peft, an entry that selects nothing is an error (naming --target-modules).
The trainer's decoder keeps q/k/v and gate/up as separate modules (models/decoder.py; only the
engine fuses them, from the merged weights), so each HF module gets its own adapter, exactly
peft's per-module adapters.

peft's adapter file (adapter_model.safetensors) names A of q_proj in layer 0
"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": peft's wrapper prefix, the HF
parameter path, and no adapter name. `peft_key` / `our_adapter_name` map both ways.
"""
from __future__ import annotations

from torch import nn

from furlong.models.hf_io import hf_name
from furlong.models.lora import ADAPTER_PARAMS

ALL_LINEAR = "all-linear"
PEFT_PREFIX = "base_model.model."


def parse_target_modules(flag: str) -> tuple[str, ...]:
    """--target-modules text -> ("all-linear",) or the stripped, non-empty names; ValueError naming the flag."""
    if flag.strip().lower() == ALL_LINEAR:
        return (ALL_LINEAR,)
    names = tuple(s.strip() for s in flag.split(","))
    if not names or any(not s for s in names):
        raise ValueError(f"--target-modules: expected 'all-linear' or comma-separated module names, got {flag!r}")
    return names


def hf_module_name(name: str) -> str:
    """Our module name -> HF's ("layers.0.mlp.up_proj" -> "model.layers.0.mlp.up_proj")."""
    return hf_name(name + ".weight")[: -len(".weight")]


def decoder_linears(model: nn.Module) -> list[str]:
    """Our names of the Linear layers inside the decoder blocks (in model order; the LM head is not one)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("layers.")]


def resolve_targets(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Our module names of the Linear layers `targets` selects (module docstring)."""
    candidates = decoder_linears(model)
    if targets == (ALL_LINEAR,):
        return candidates
    hf = {n: hf_module_name(n) for n in candidates}
    chosen = []
    for entry in targets:
        hits = [n for n in candidates if hf[n] == entry or hf[n].endswith("." + entry)]
        if not hits:
            leaves = sorted({n.rpartition(".")[2] for n in candidates})
            raise ValueError(f"--target-modules: {entry!r} matches no linear layer of the decoder "
                             f"(its layers: {', '.join(leaves)}; or all-linear)")
        chosen += hits
    wanted = set(chosen)
    return [n for n in candidates if n in wanted]


def peft_key(name: str) -> str:
    """Our adapter parameter name -> peft's key ("layers.0.self_attn.q_proj.lora_A" ->
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")."""
    module, _, leaf = name.rpartition(".")
    if leaf not in ADAPTER_PARAMS:
        raise ValueError(f"{name!r} is not a LoRA adapter parameter")
    return f"{PEFT_PREFIX}{hf_module_name(module)}.{leaf}.weight"


def our_adapter_name(key: str) -> str:
    """peft's key -> our adapter parameter name (inverse of peft_key); ValueError for any other key."""
    body = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else None
    parts = body.rsplit(".", 2) if body is not None else []
    if len(parts) != 3 or parts[1] not in ADAPTER_PARAMS or parts[2] != "weight" or not parts[0].startswith("model."):
        raise ValueError(f"{key!r} is not a peft LoRA adapter key")
    name = f"{parts[0][len('model.'):]}.{parts[1]}"
    if peft_key(name) != key:
        raise ValueError(f"{key!r} is not a peft LoRA adapter key")
    return name


def target_module_leaves(module_names: list[str]) -> list[str]:
    """The distinct leaf names ("q_proj", ...) of adapted modules: adapter_config.json's target_modules."""
    return sorted({n.rpartition(".")[2] for n in module_names})
