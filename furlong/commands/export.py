"""`furlong export`: a training checkpoint (DCP shards) -> an HF checkpoint dir (docs/design.md §4).

Single process, no process group: the model is built from the original HF
checkpoint's config.json, the latest DCP checkpoint under --load is read into
it (DCP reshards to full tensors on load), and models.hf_io.save_hf writes
safetensors + config.json + the original tokenizer files, loadable by
transformers. The original checkpoint (recorded in the DCP checkpoint, or given
explicitly) supplies config and tokenizer. Weights are written in the original
checkpoint's dtype unless `dtype` says otherwise (the fp32 masters are cast).

A LoRA checkpoint (its trainer.pt records the adapters' LoraConfig) holds only adapters: by
default they are written as a peft adapter folder (models/lora_export.py) for the base
--hf-checkpoint; with `merged` (--merged) base + adapters are written as one HF checkpoint.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from furlong.checkpoint.lora import load_adapters, lora_config_of
from furlong.checkpoint.store import SaveError, load_model_weights
from furlong.checkpoint.verify import CheckpointChoice, choose_checkpoint, shape_mismatch
from furlong.lora_flags import checkpoint_shapes
from furlong.models.hf_config import ModelArgs
from furlong.models.hf_io import load_pretrained, save_hf
from furlong.models.lora import LoraConfig, apply_lora
from furlong.models.lora_export import save_merged_hf, save_peft_adapter
from furlong.models.lora_names import resolve_targets
from furlong.safe_paths import check_dir_target

log = logging.getLogger(__name__)


def source_checkpoint(load_dir: str | Path, trainer_state: dict, hf_checkpoint: str | Path | None) -> str:
    """The original HF checkpoint of a training checkpoint: the one given, else the one it records
    (`furlong export` and `furlong eval --load` share this rule)."""
    if hf_checkpoint is None:
        hf_checkpoint = trainer_state.get("hf_checkpoint")
        if hf_checkpoint is None:
            raise ValueError(f"--hf-checkpoint: {load_dir} does not record its source checkpoint; pass it")
    if not Path(hf_checkpoint).is_dir():
        raise ValueError(f"--hf-checkpoint: {hf_checkpoint} is not a directory")
    return str(hf_checkpoint)


def export_hf(load_dir: str | Path, output_dir: str | Path, hf_checkpoint: str | Path | None = None,
              dtype: torch.dtype | None = None, ckpt_step: int | None = None, overwrite: bool = False,
              merged: bool = False) -> Path:
    """Write the latest (or `ckpt_step`) checkpoint under `load_dir` as an HF checkpoint into `output_dir`
    (a LoRA checkpoint: a peft adapter folder, or with `merged` the merged HF checkpoint).
    `output_dir` must be new or empty (or `overwrite`), and never one of the sources (safe_paths)."""
    choice = choose_checkpoint(load_dir, ckpt_step, None)   # intact, else one line naming an earlier one
    hf_checkpoint = source_checkpoint(load_dir, choice.trainer_state, hf_checkpoint)
    output_dir = check_dir_target(output_dir, "--output", {"--load": load_dir, "--hf-checkpoint": hf_checkpoint},
                                  overwrite)
    args = ModelArgs.from_dir(hf_checkpoint)
    spec = lora_config_of(choice.trainer_state)
    # the shapes come from config.json alone (and the adapters' spec): another model's --hf-checkpoint is
    # refused before any load
    mismatch = shape_mismatch(choice.path, checkpoint_shapes(args, spec))
    if mismatch is not None:
        raise ValueError(f"--hf-checkpoint: {hf_checkpoint} is another model than the checkpoint "
                         f"{choice.path}: {mismatch}")
    out_dtype = dtype if dtype is not None else args.torch_dtype
    try:
        if spec is not None:
            return _export_lora(choice, spec, args, hf_checkpoint, Path(output_dir), merged, out_dtype)
        model = load_pretrained(hf_checkpoint, dtype=torch.float32, device="cpu")
        iteration = load_model_weights(load_dir, model, choice.iteration)
        model.to(out_dtype)
        out = save_hf(model, args, output_dir, tokenizer_src=hf_checkpoint)
    except OSError as e:   # disk full, read-only: one line; the target holds what it held before
        raise SaveError(f"--output: writing {output_dir} failed ({e.strerror or e})") from e
    log.info("exported iteration %d of %s to %s (%s)", iteration, load_dir, out, out_dtype)
    return out


def _export_lora(choice: CheckpointChoice, spec: LoraConfig, args: ModelArgs, hf_checkpoint: str, output_dir: Path,
                 merged: bool, dtype: torch.dtype) -> Path:
    model = load_pretrained(hf_checkpoint, dtype=torch.float32, device="cpu")
    apply_lora(model, spec, resolve_targets(model, spec.target_modules))
    load_adapters(choice.path, model)
    if merged:
        out = save_merged_hf(model, args, output_dir, tokenizer_src=hf_checkpoint, dtype=dtype)
    else:
        out = save_peft_adapter(model, spec, output_dir, base_model=hf_checkpoint)
    log.info("exported the LoRA adapters of iteration %d (%s) to %s", choice.iteration,
             "merged HF checkpoint" if merged else "peft folder", out)
    return out
