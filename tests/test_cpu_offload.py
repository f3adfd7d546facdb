"""--fsdp-cpu-offload: the offloaded step equals the normal one (weights after two optimizer steps),
in one process and over 2 gloo ranks. On the CPU the offload policy places nothing elsewhere, so this
checks FSDP2's offload path (its sharding, gradient and optimizer-step handling) and furlong's
flag plumbing, not the GPU<->CPU copies (bench: the Qwen3-8B shape with offload on the device)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_actor import full_weights, synthetic_samples, tiny_ckpt, tiny_config, train_rollout  # noqa: E402,F401

from furlong.config_map import actor_config  # noqa: E402
from furlong.launch.distributed import init_distributed, launch_local  # noqa: E402
from furlong.models.hf_io import load_pretrained  # noqa: E402
from furlong.trainer.actor import Actor  # noqa: E402

LENGTHS = [20, 12, 10, 9, 8, 7]


def two_steps(ckpt: str, offload: bool) -> dict[str, torch.Tensor]:
    cfg = tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="24", global_batch_size=3,
                      clip_grad=1.0, fsdp_cpu_offload=offload)
    actor = Actor(load_pretrained(ckpt), actor_config(cfg), init_distributed("cpu"))
    assert actor_config(cfg).shard.cpu_offload == offload
    from torch.distributed.fsdp import CPUOffloadPolicy
    group = actor.model.layers[0]._get_fsdp_state()._fsdp_param_group
    assert isinstance(group.offload_policy, CPUOffloadPolicy) == offload
    m = train_rollout(actor, cfg, synthetic_samples(LENGTHS))
    assert m.num_steps == 2
    return full_weights(actor)


def _worker(ckpt: str, out: str) -> None:
    res = {flag: two_steps(ckpt, flag) for flag in (False, True)}
    if torch.distributed.get_rank() == 0:
        torch.save(res, out)


def test_offloaded_step_equals_normal_step_one_process(tiny_ckpt):
    normal, offloaded = two_steps(str(tiny_ckpt), False), two_steps(str(tiny_ckpt), True)
    start = {n: p.float() for n, p in load_pretrained(str(tiny_ckpt)).state_dict().items()}
    assert max((normal[n] - start[n]).abs().max().item() for n in normal) > 1e-4   # the steps moved the weights
    for n, w in normal.items():
        torch.testing.assert_close(offloaded[n], w, rtol=0, atol=0, msg=n)


def test_offloaded_step_equals_normal_step_two_ranks(tiny_ckpt, tmp_path):
    out = tmp_path / "res.pt"
    launch_local(_worker, 2, str(tiny_ckpt), str(out))
    res = torch.load(out, weights_only=False)
    for n, w in res[False].items():
        torch.testing.assert_close(res[True][n], w, rtol=0, atol=0, msg=n)
    ref = two_steps(str(tiny_ckpt), False)   # and 2 ranks equal 1 process (float32 reduction order)
    for n, w in ref.items():
        torch.testing.assert_close(res[True][n], w, rtol=1e-5, atol=1e-7, msg=n)
