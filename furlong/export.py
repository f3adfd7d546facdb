"""`furlong export`: a training checkpoint (DCP shards) -> an HF checkpoint dir (docs/design.md §4).

Single process, no process group: the model is built from the original HF
checkpoint's config.json, the latest DCP checkpoint under --load is read into
it (DCP reshards to full tensors on load), and models.hf_io.save_hf writes
safetensors + config.json + the original tokenizer files, loadable by
transformers. The original checkpoint (recorded in the DCP checkpoint, or given
explicitly) supplies config and tokenizer. Weights are written in the original
checkpoint's dtype unless `dtype` says otherwise (the fp32 masters are cast).

A LoRA checkpoint (its trainer.pt records the adapters' LoraSpec) holds only adapters: by
default they are written as a peft adapter folder (models/lora_export.py) for the base
--hf-checkpoint; with `merged` (--merged) base + adapters are written as one HF checkpoint.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from furlong.models.hf_config import ModelArgs
from furlong.models.hf_io import load_pretrained, save_hf
from furlong.models.lora import LoraSpec, adapter_state_dict, apply_lora
from furlong.models.lora_export import save_merged_hf, save_peft_adapter
from furlong.models.lora_names import resolve_targets
from furlong.train.checkpoint import load_model_weights
from furlong.train.checkpoint_verify import CheckpointChoice, choose_checkpoint, shape_mismatch
from furlong.train.lora_checkpoint import load_adapters, lora_spec_of

log = logging.getLogger(__name__)


def export_hf(load_dir: str | Path, output_dir: str | Path, hf_checkpoint: str | Path | None = None,
              dtype: torch.dtype | None = None, ckpt_step: int | None = None, merged: bool = False) -> Path:
    """Write the latest (or `ckpt_step`) checkpoint under `load_dir` as an HF checkpoint into `output_dir`
    (a LoRA checkpoint: a peft adapter folder, or with `merged` the merged HF checkpoint)."""
    choice = choose_checkpoint(load_dir, ckpt_step, None)   # intact, else one line naming an earlier one
    if hf_checkpoint is None:
        hf_checkpoint = choice.trainer_state.get("hf_checkpoint")
        if hf_checkpoint is None:
            raise ValueError(f"--hf-checkpoint: {load_dir} does not record its source checkpoint; pass it")
    if not Path(hf_checkpoint).is_dir():
        raise ValueError(f"--hf-checkpoint: {hf_checkpoint} is not a directory")
    spec = lora_spec_of(choice.trainer_state)
    if spec is not None:
        return _export_lora(choice, spec, Path(hf_checkpoint), Path(output_dir), merged, dtype)
    args = ModelArgs.from_dir(hf_checkpoint)
    model = load_pretrained(hf_checkpoint, dtype=torch.float32, device="cpu")
    mismatch = shape_mismatch(choice.path, {k: tuple(t.shape) for k, t in model.state_dict().items()})
    if mismatch is not None:
        raise ValueError(f"--load: {choice.path} is a checkpoint of another model: {mismatch}")
    iteration = load_model_weights(load_dir, model, choice.iteration)
    out_dtype = dtype if dtype is not None else args.torch_dtype
    model.to(out_dtype)
    out = save_hf(model, args, output_dir, tokenizer_src=hf_checkpoint)
    log.info("exported iteration %d of %s to %s (%s)", iteration, load_dir, out, out_dtype)
    return out


def _export_lora(choice: CheckpointChoice, spec: LoraSpec, hf_checkpoint: Path, output_dir: Path, merged: bool,
                 dtype: torch.dtype | None) -> Path:
    model = load_pretrained(hf_checkpoint, dtype=torch.float32, device="cpu")
    apply_lora(model, spec, resolve_targets(model, spec.target_modules))
    mismatch = shape_mismatch(choice.path, {k: tuple(t.shape) for k, t in adapter_state_dict(model).items()})
    if mismatch is not None:
        raise ValueError(f"--load: {choice.path} is not a LoRA checkpoint of --hf-checkpoint {hf_checkpoint}: {mismatch}")
    load_adapters(choice.path, model)
    if merged:
        args = ModelArgs.from_dir(hf_checkpoint)
        out = save_merged_hf(model, args, output_dir, tokenizer_src=hf_checkpoint,
                             dtype=dtype if dtype is not None else args.torch_dtype)
    else:
        out = save_peft_adapter(model, spec, output_dir, base_model=str(hf_checkpoint))
    log.info("exported the LoRA adapters of iteration %d (%s) to %s", choice.iteration,
             "merged HF checkpoint" if merged else "peft folder", out)
    return out
