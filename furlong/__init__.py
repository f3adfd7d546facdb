"""furlong: compact, fast RL post-training (GRPO/PPO) for HuggingFace-format causal LMs."""
from __future__ import annotations

__version__ = "0.1.0"


def load_pretrained(path, dtype=None, device=None):
    """Build the decoder for an HF checkpoint directory and load its weights (see furlong.models.hf_io)."""
    from furlong.models.hf_io import load_pretrained as _load
    return _load(path, dtype=dtype, device=device)


__all__ = ["load_pretrained", "__version__"]
