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
from furlong.train.checkpoint import checkpoint_hf_source, load_model_weights

log = logging.getLogger(__name__)


def export_hf(load_dir: str | Path, output_dir: str | Path, hf_checkpoint: str | Path | None = None,
              dtype: torch.dtype | None = None) -> Path:
    """Write the latest checkpoint under `load_dir` as an HF checkpoint into `output_dir`."""
    if hf_checkpoint is None:
        hf_checkpoint = checkpoint_hf_source(load_dir)
        if hf_checkpoint is None:
            raise ValueError(f"--hf-checkpoint: {load_dir} does not record its source checkpoint; pass it")
    if not Path(hf_checkpoint).is_dir():
        raise ValueError(f"--hf-checkpoint: {hf_checkpoint} is not a directory")
    args = ModelArgs.from_dir(hf_checkpoint)
    model = load_pretrained(hf_checkpoint, dtype=torch.float32, device="cpu")
    iteration = load_model_weights(load_dir, model)
    out_dtype = dtype if dtype is not None else args.torch_dtype
    model.to(out_dtype)
    out = save_hf(model, args, output_dir, tokenizer_src=hf_checkpoint)
    log.info("exported iteration %d of %s to %s (%s)", iteration, load_dir, out, out_dtype)
    return out
