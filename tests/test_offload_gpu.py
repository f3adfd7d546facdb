"""GPU checks of what the CPU tests can only check as arithmetic (offload is a placement no-op there):
--fsdp-cpu-offload's step on CUDA (pinned CPU shards, the fused CPU AdamW) against the resident step, and
the KL reference kept in CPU memory (--ref-placement cpu) against the resident one: same reference
log-probs, and the GPU memory it no longer holds."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_actor import full_weights, synthetic_samples, tiny_ckpt, tiny_config, train_rollout  # noqa: E402,F401

from furlong.config_map import actor_config, batching_config  # noqa: E402
from furlong.launch.distributed import init_distributed  # noqa: E402
from furlong.models.hf_io import load_pretrained  # noqa: E402
from furlong.trainer.actor import Actor  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENGTHS = [20, 12, 10, 9, 8, 7]


def _cfg(**kw):
    return tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="24", global_batch_size=3, clip_grad=1.0,
                       torch_compile="off", **kw)


def test_offloaded_step_on_cuda_matches_the_resident_step(tiny_ckpt):
    weights = {}
    for offload in (False, True):
        cfg = _cfg(fsdp_cpu_offload=offload)
        actor = Actor(load_pretrained(tiny_ckpt), actor_config(cfg), init_distributed("cuda"))
        shard = next(actor.model.parameters()).to_local()
        assert shard.device.type == ("cpu" if offload else "cuda") and (shard.is_pinned() or not offload)
        train_rollout(actor, cfg, synthetic_samples(LENGTHS))
        weights[offload] = {n: w.cpu() for n, w in full_weights(actor).items()}
        del actor
    start = {n: p.float() for n, p in load_pretrained(tiny_ckpt).state_dict().items()}
    assert max((weights[False][n] - start[n]).abs().max().item() for n in start) > 1e-4
    for n, w in weights[False].items():
        # same bf16 forward/backward; AdamW fused on the CPU vs on the GPU: fp32 rounding apart
        torch.testing.assert_close(weights[True][n], w, rtol=1e-5, atol=1e-6, msg=n)


def _ref_gpu_bytes(ref: torch.nn.Module) -> int:
    """Bytes of the reference's local parameter shards that sit on the GPU."""
    return sum(t.numel() * t.element_size() for t in (p.to_local() if hasattr(p, "to_local") else p
                                                    for p in ref.parameters()) if t.device.type == "cuda")


def _settled_allocated(dev: torch.device) -> int:
    """GPU bytes held by live tensors, after collecting garbage (an earlier test's trainer freed by a later
    collection would otherwise lower the next difference measured) and letting the stream finish."""
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(dev)


def test_reference_in_cpu_memory_gives_the_same_log_probs_and_frees_its_copy(tiny_ckpt):
    dev = torch.device("cuda")
    out, held, held_after, ref_gpu = {}, {}, {}, {}
    for placement in ("gpu", "cpu"):
        cfg = _cfg(use_kl_loss=True, kl_loss_coef=0.1, ref_placement=placement)
        before = _settled_allocated(dev)
        actor = Actor(load_pretrained(tiny_ckpt), actor_config(cfg), init_distributed("cuda"))
        held[placement] = _settled_allocated(dev) - before
        out[placement] = actor.compute_log_probs(synthetic_samples(LENGTHS), batching_config(cfg), "ref")
        held_after[placement] = _settled_allocated(dev) - before     # between passes: gathered weights resharded
        ref_gpu[placement] = _ref_gpu_bytes(actor.ref_model)
        del actor
    for a, b in zip(out["gpu"], out["cpu"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref_bytes = 2 * sum(p.numel() for p in load_pretrained(tiny_ckpt).parameters())   # the bf16 copy
    assert ref_gpu["cpu"] == 0 and ref_gpu["gpu"] >= 0.9 * ref_bytes, (ref_gpu, ref_bytes)
    # what the allocator holds says the same, at build and after a pass (a stray GPU copy would show here)
    assert held["gpu"] - held["cpu"] >= 0.9 * ref_bytes, (held, held_after, ref_bytes)
    assert held_after["gpu"] - held_after["cpu"] >= 0.9 * ref_bytes, (held, held_after, ref_bytes)
