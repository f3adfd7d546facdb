"""A LoRA run's checkpoint outside training (export, `furlong eval --load`): single process, no process group.

A LoRA checkpoint's DCP shards hold only the adapters ("model.layers.0.self_attn.q_proj.lora_A", ...)
and their AdamW state; trainer.pt records the LoraConfig under "lora" (store.py). The base is the
--hf-checkpoint the run trained from. DCP reshards to full tensors on load, so a checkpoint saved at
any world size reads here. Adapters holding NaN/inf are refused, as store.py refuses such weights.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from furlong.checkpoint.store import nonfinite_tensor
from furlong.models.lora import LoraConfig, adapter_state_dict, apply_lora, merged_weight
from furlong.models.lora_names import resolve_targets


def lora_config_of(trainer_state: dict[str, Any]) -> LoraConfig | None:
    """The LoraConfig a checkpoint's trainer.pt records; None for a full-parameter checkpoint."""
    rec = trainer_state.get("lora")
    if rec is None:
        return None
    return LoraConfig(rank=int(rec["rank"]), alpha=float(rec["alpha"]), dropout=float(rec["dropout"]),
                      target_modules=tuple(rec["target_modules"]), seed=int(rec["seed"]))


def _read(path: str | Path, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
    """The named adapters of checkpoint `path`; ValueError (one line) if one holds NaN/inf."""
    state = {"model": {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}}
    with warnings.catch_warnings():  # DCP warns that it assumes one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    bad = nonfinite_tensor(state["model"].items())
    if bad is not None:
        raise ValueError(f"--load: {path}: weight {bad!r} holds NaN or inf values (damaged checkpoint?)")
    return state["model"]


def load_adapters(path: str | Path, model: nn.Module) -> None:
    """Read the adapters of the checkpoint directory `path` (an iter_* dir) into `model` (adapted, unsharded)."""
    targets = adapter_state_dict(model)
    loaded = _read(path, {k: (p.shape, p.dtype) for k, p in targets.items()})
    with torch.no_grad():
        for k, p in targets.items():
            p.copy_(loaded[k])


def merge_checkpoint_adapters(path: str | Path, model: nn.Module, spec: LoraConfig) -> None:
    """Fold the adapters of checkpoint `path` into the plain decoder `model`'s weights, in place
    (its dtype and device; the sums in fp32). The adapters are read into a meta-built skeleton's
    shapes, so no second copy of the base is made."""
    with torch.device("meta"):
        skeleton = type(model)(model.args)
    names = apply_lora(skeleton, spec, resolve_targets(skeleton, spec.target_modules))
    loaded = _read(path, {k: (p.shape, torch.float32) for k, p in adapter_state_dict(skeleton).items()})
    with torch.no_grad():
        for name in names:
            w = model.get_submodule(name).weight
            a, b = loaded[f"{name}.lora_A"], loaded[f"{name}.lora_B"]
            w.copy_(merged_weight(w, a.to(w.device), b.to(w.device), spec.scaling))
