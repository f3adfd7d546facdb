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
from furlong.models.hf_io import load_pretrained, save_hf
from furlong.checkpoint.store import load_model_weights
from furlong.checkpoint.verify import choose_checkpoint, shape_mismatch

log = logging.getLogger(__name__)


def export_hf(load_dir: str | Path, output_dir: str | Path, hf_checkpoint: str | Path | None = None,
              dtype: torch.dtype | None = None, ckpt_step: int | None = None) -> Path:
    """Write the latest (or `ckpt_step`) checkpoint under `load_dir` as an HF checkpoint into `output_dir`."""
    choice = choose_checkpoint(load_dir, ckpt_step, None)   # intact, else one line naming an earlier one
    if hf_checkpoint is None:
        hf_checkpoint = choice.trainer_state.get("hf_checkpoint")
        if hf_checkpoint is None:
            raise ValueError(f"--hf-checkpoint: {load_dir} does not record its source checkpoint; pass it")
    if not Path(hf_checkpoint).is_dir():
        raise ValueError(f"--hf-checkpoint: {hf_checkpoint} is not a directory")
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
