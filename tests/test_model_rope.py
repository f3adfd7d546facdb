"""Scaled RoPE (Llama 3.1's, linear, YaRN) in furlong.models against transformers on a tiny
random llama checkpoint, and through a save_hf / load_pretrained round trip."""
from __future__ import annotations

import pytest
import torch

from furlong.models import load_pretrained, save_hf
from furlong.models.rope import rope_inv_freq
from test_model import VOCAB, _hf_logits
from tiny_checkpoints import write_tiny_checkpoint


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("scaling", [
    LLAMA3_ROPE, {"rope_type": "linear", "factor": 4.0}, YARN_ROPE,
    {**YARN_ROPE, "truncate": False, "attention_factor": 1.3, "beta_fast": 16.0}],
    ids=["llama3", "linear", "yarn", "yarn-untruncated"])
def test_rope_scaling_matches_transformers(tmp_path, scaling):
    """Scaled RoPE (Llama 3.1's, linear, YaRN with its attention factor) gives transformers' logits
    over 200 positions, and survives a save/load round trip (ours and transformers' reading of the
    saved config). head_dim 8, theta 1e4: wavelengths 6.3, 63, 628 and 6283 positions put one
    frequency in each llama3 band (kept, interpolated, divided) for an original context of 64, and
    YaRN's ramp runs over pairs 0..2 (kept, blended, divided)."""
    path = write_tiny_checkpoint(tmp_path / "ckpt", family="llama", vocab_size=VOCAB, hidden=32, heads=4,
                                 kv_heads=2, rope_scaling=scaling)
    model = load_pretrained(path)
    assert model.args.rope_scaling is not None and model.args.rope_scaling.rope_type == scaling["rope_type"]
    plain = rope_inv_freq(model.args.head_dim, model.args.rope_theta)
    assert not torch.allclose(model.inv_freq, plain)   # the scaling is in effect
    ids = torch.randint(0, VOCAB, (2, 200), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids)
    torch.testing.assert_close(ours, _hf_logits(path, ids), rtol=1e-4, atol=1e-4)
    save_hf(model, model.args, tmp_path / "saved")
    again = load_pretrained(tmp_path / "saved")
    assert again.args.rope_scaling == model.args.rope_scaling
    torch.testing.assert_close(again.inv_freq, model.inv_freq)
    torch.testing.assert_close(_hf_logits(tmp_path / "saved", ids), ours, rtol=1e-4, atol=1e-4)   # as saved
