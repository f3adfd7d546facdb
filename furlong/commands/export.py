"""`furlong export`: a training checkpoint (DCP shards) -> an HF checkpoint dir (docs/design.md §4).

Single process, no process group: the model is built from the original HF
checkpoint's config.json, the latest DCP checkpoint under --load is read into
it (DCP reshards to full tensors on load), and models.hf_io.save_hf writes
safetensors + config.json + the original tokenizer files, loadable by
transformers. The original checkpoint (recorded in the DCP checkpoint, or given
explicitly) supplies config and tokenizer. Weights are written in the original
checkpoint's dtype unless `dtype` says otherwise (the fp32 masters are cast).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from furlong.models.hf_config import ModelArgs
from furlong.models.hf_io import load_pretrained, param_shapes, save_hf
from furlong.safe_paths import check_dir_target
from furlong.checkpoint.store import SaveError, load_model_weights
from furlong.checkpoint.verify import choose_checkpoint, shape_mismatch

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
              dtype: torch.dtype | None = None, ckpt_step: int | None = None, overwrite: bool = False) -> Path:
    """Write the latest (or `ckpt_step`) checkpoint under `load_dir` as an HF checkpoint into `output_dir`.
    `output_dir` must be new or empty (or `overwrite`), and never one of the sources (safe_paths)."""
    choice = choose_checkpoint(load_dir, ckpt_step, None)   # intact, else one line naming an earlier one
    hf_checkpoint = source_checkpoint(load_dir, choice.trainer_state, hf_checkpoint)
    output_dir = check_dir_target(output_dir, "--output", {"--load": load_dir, "--hf-checkpoint": hf_checkpoint},
                                  overwrite)
    args = ModelArgs.from_dir(hf_checkpoint)
    # the shapes come from config.json alone: another model's --hf-checkpoint is refused before any load
    mismatch = shape_mismatch(choice.path, param_shapes(args))
    if mismatch is not None:
        raise ValueError(f"--hf-checkpoint: {hf_checkpoint} is another model than the checkpoint "
                         f"{choice.path}: {mismatch}")
    model = load_pretrained(hf_checkpoint, dtype=torch.float32, device="cpu")
    iteration = load_model_weights(load_dir, model, choice.iteration)
    out_dtype = dtype if dtype is not None else args.torch_dtype
    model.to(out_dtype)
    try:
        out = save_hf(model, args, output_dir, tokenizer_src=hf_checkpoint)
    except OSError as e:   # disk full, read-only: one line; the target holds what it held before
        raise SaveError(f"--output: writing {output_dir} failed ({e.strerror or e})") from e
    log.info("exported iteration %d of %s to %s (%s)", iteration, load_dir, out, out_dtype)
    return out
