"""Write a LoRA model out: a peft adapter folder, or the merged HF checkpoint.

peft folder: adapter_config.json (peft_type LORA, r, lora_alpha, lora_dropout, target_modules,
the base checkpoint) and adapter_model.safetensors with peft's keys (lora_names.peft_key), A and
B in fp32; `peft.PeftModel.from_pretrained(base, folder)` loads it onto the transformers model of
the base checkpoint. target_modules is written as the adapted modules' leaf names ("q_proj") when
those select exactly the adapted modules, else as their full HF names (a subset of layers).
Merged: W + s B A for every adapted weight (lora.merged_state_dict), through hf_io.save_hf.
Both write a temporary folder and move it in by safe_paths' rules (into a non-empty target only the
checkpoint's own files are replaced); a sharded (DTensor) adapter is gathered first, a collective
every rank must call.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from furlong.models.hf_config import ModelArgs
from furlong.models.hf_io import save_hf
from furlong.models.lora import LoraConfig, adapter_state_dict, lora_modules, merged_state_dict
from furlong.models.lora_names import decoder_linears, hf_module_name, peft_key, target_module_leaves


def _full_cpu(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):   # an FSDP shard: gather (collective)
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous()


def _peft_targets(model: nn.Module) -> list[str]:
    adapted = sorted(lora_modules(model))
    leaves = target_module_leaves(adapted)
    projections = set(decoder_linears(model)) | set(adapted)   # every projection, adapted or not
    by_leaf = sorted(n for n in projections if n.rpartition(".")[2] in leaves)
    return leaves if by_leaf == adapted else [hf_module_name(n) for n in adapted]


def adapter_config(model: nn.Module, spec: LoraConfig, base_model: str | None) -> dict:
    """adapter_config.json's fields (peft fills the rest with its defaults)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": _peft_targets(model), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": None if base_model is None else str(base_model)}


def _replace_dir(out_dir: Path, write) -> Path:
    """As hf_io.save_hf: written in a temporary folder, then moved in (safe_paths.install_checkpoint)."""
    from furlong.safe_paths import install_checkpoint, remove_stale_temps, temp_prefix
    out_dir = out_dir.resolve()   # a symlink's target receives the folder; the link stays
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir), dir=out_dir.parent))
    os.chmod(tmp, 0o755)
    try:
        write(tmp)
        install_checkpoint(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def save_peft_adapter(model: nn.Module, spec: LoraConfig, out_dir: str | Path, base_model: str | None = None) -> Path:
    """Write `model`'s adapters as a peft LoRA folder (`base_model`: adapter_config's base_model_name_or_path)."""
    tensors = {peft_key(n): _full_cpu(p).float() for n, p in adapter_state_dict(model).items()}
    if not tensors:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters")
    config = adapter_config(model, spec, base_model)

    def _write(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    return _replace_dir(Path(out_dir), _write)


def save_merged_hf(model: nn.Module, args: ModelArgs, out_dir: str | Path, tokenizer_src: str | Path | None = None,
                   dtype: torch.dtype | None = None) -> Path:
    """Write base + adapters as one HF checkpoint (unsharded model), in `dtype` (default: the base weights')."""
    sd = merged_state_dict(model)
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    return save_hf(sd, args, out_dir, tokenizer_src=tokenizer_src)
