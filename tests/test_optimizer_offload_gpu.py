"""GPU checks of --optimizer-cpu-offload's CUDA path (trainer/optimizer_offload.py), which the CPU tests
cannot reach: pinned host moments, three device slots cycled by two side streams, the fused update on
slices. Small buckets force many more buckets than slots, so every slot is reused while its previous
bucket may still be copying out: a missing event between the streams shows up as wrong weights."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_actor import full_weights, synthetic_samples, tiny_ckpt, tiny_config, train_rollout  # noqa: E402,F401

from furlong.config_map import actor_config  # noqa: E402
from furlong.launch.distributed import init_distributed  # noqa: E402
from furlong.models.hf_io import load_pretrained  # noqa: E402
from furlong.trainer.actor import Actor  # noqa: E402
from furlong.trainer.optimizer_offload import OffloadedAdamW  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENGTHS = [20, 12, 10, 9, 8, 7]


def test_streamed_update_equals_fused_adamw_over_many_buckets():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    shapes = [(257, 129), (4099,), (64, 64), (1,), (300, 70)]   # odd sizes: buckets split parameters
    ref = [torch.randn(s, device=dev, generator=g) for s in shapes]
    off = [p.clone() for p in ref]
    kw = dict(lr=3e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref, fused=True, **kw)
    # 4 KiB buckets: 512 moment elements each, ~180 buckets for 3 slots
    opt_off = OffloadedAdamW(off, fused=True, bucket_bytes=4096, **kw)
    assert len(opt_off.buckets) > 50
    assert all(b.device.type == "cpu" for b in opt_off.host.values())
    for step in range(4):
        grads = [torch.randn(s, device=dev, generator=g) for s in shapes]
        for p, q, gr in zip(ref, off, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt_ref.step()
        opt_off.step()
        # the slots and copies of the next step reuse memory at once: no host sync between steps on purpose
    torch.cuda.synchronize()
    for p, q in zip(ref, off):
        torch.testing.assert_close(q, p, rtol=0, atol=0)   # the same fused kernel, elementwise, on slices
    for p, q in zip(ref, off):
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt_off.state[q][k].cpu(), opt_ref.state[p][k].cpu(), rtol=0, atol=0)
        assert float(opt_off.state[q]["step"]) == 4.0


def test_actor_step_with_offloaded_moments_matches_the_resident_step(tiny_ckpt):
    weights, moment_bytes = {}, {}
    for offload in (False, True):
        cfg = tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="24", global_batch_size=3, clip_grad=1.0,
                          torch_compile="off", optimizer_cpu_offload=offload)
        actor = Actor(load_pretrained(tiny_ckpt), actor_config(cfg), init_distributed("cuda"))
        assert isinstance(actor.optimizer, OffloadedAdamW) == offload
        train_rollout(actor, cfg, synthetic_samples(LENGTHS))
        train_rollout(actor, cfg, synthetic_samples(LENGTHS))
        weights[offload] = {n: w.cpu() for n, w in full_weights(actor).items()}
        moment_bytes[offload] = sum(t.to_local().numel() * 4 for s in actor.optimizer.state.values()
                                    for k, t in s.items() if k != "step" and t.to_local().device.type == "cuda")
        del actor
    assert moment_bytes[True] == 0 and moment_bytes[False] > 0
    start = {n: p.float() for n, p in load_pretrained(tiny_ckpt).state_dict().items()}
    assert max((weights[False][n] - start[n]).abs().max().item() for n in start) > 1e-4
    for n, w in weights[False].items():
        torch.testing.assert_close(weights[True][n], w, rtol=0, atol=0, msg=n)
