"""--gradient-checkpointing: recompute trains exactly like the plain step (bf16 too); MFU peaks.

Recompute gives the loss, gradients and update of the plain step, in bf16 as on the GPU (fp32 alone hid a dtype mismatch between saved and recomputed tensors);
and the MFU peak comes from the device in use."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_actor import synthetic_samples, tiny_config  # noqa: E402
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402
from furlong.models.hf_io import load_pretrained  # noqa: E402
from furlong.config_map import actor_config, batching_config  # noqa: E402
from furlong.trainer.actor import Actor  # noqa: E402
from furlong.launch.distributed import init_distributed  # noqa: E402
from furlong.trainer.mfu import peak_bf16_flops  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("rc") / "m", vocab_size=128, hidden=32, layers=3, heads=4,
                                 kv_heads=2, tie=False, init_std=0.05)


def _step(ckpt, device: str, recompute: bool, compile: str = "off"):
    torch.manual_seed(0)
    ctx = init_distributed(device)
    cfg = tiny_config(dtype="bf16", gradient_checkpointing=recompute, torch_compile=compile)
    actor = Actor(load_pretrained(ckpt, dtype=torch.float32, device=ctx.device), actor_config(cfg), ctx)
    m = actor.train_step(synthetic_samples([9, 14, 7, 20, 31, 5]), batching_config(cfg))
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
              for n, p in actor.model.named_parameters()}
    return m, params


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_recompute_matches_plain_step_in_bf16(ckpt, device):
    plain, p0 = _step(ckpt, device, recompute=False)
    rec, p1 = _step(ckpt, device, recompute=True)
    assert rec.loss == pytest.approx(plain.loss, abs=1e-6) and rec.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)
    for n in p0:
        torch.testing.assert_close(p1[n], p0[n], atol=0, rtol=0, msg=n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_recompute_with_compiled_layers_on_gpu(ckpt):
    plain, p0 = _step(ckpt, "cuda", recompute=False, compile="on")
    rec, p1 = _step(ckpt, "cuda", recompute=True, compile="on")
    assert rec.loss == pytest.approx(plain.loss, rel=1e-3) and rec.grad_norm == pytest.approx(plain.grad_norm, rel=1e-2)
    for n in p0:
        torch.testing.assert_close(p1[n], p0[n], atol=1e-5, rtol=1e-3, msg=n)


def test_peak_flops_from_the_device_name():
    assert peak_bf16_flops("NVIDIA H200") == (989e12, "datasheet")
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == (312e12, "datasheet")
    assert peak_bf16_flops("NVIDIA B200")[0] == 2250e12
    assert peak_bf16_flops("Some Future GPU", torch.device("cpu")) == (0.0, "unknown")
