"""The actor's memory probe: the CPU default budget for `auto` and the probe's measurement through the
actor's own loss (CUDA counters stood in for), and on a GPU a planned `auto` budget that trains (the
plan's arithmetic: test_memory_plan.py). Runs in this pytest process on a one-rank gloo group."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_actor import synthetic_samples, tiny_ckpt, tiny_config  # noqa: E402,F401 (tiny_ckpt: fixture)

from furlong.config_map import actor_config, batching_config, run_config  # noqa: E402
from furlong.launch.distributed import init_distributed  # noqa: E402
from furlong.models.hf_io import load_pretrained  # noqa: E402
from furlong.trainer.actor import Actor  # noqa: E402
from furlong.trainer.memory_probe import CPU_DEFAULT_TOKENS, plan_trainer_memory  # noqa: E402


def test_probe_on_cpu_returns_default(tiny_ckpt):
    """The probe's budget is a value the run puts into its config (RunConfig.with_max_tokens)."""
    cfg = tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="auto")
    actor = Actor(load_pretrained(tiny_ckpt), actor_config(cfg), init_distributed("cpu"))
    with pytest.raises(ValueError, match="--max-tokens-per-gpu"):
        actor.train_step(synthetic_samples([8, 9]), batching_config(cfg))
    plan = plan_trainer_memory(actor, None, False, min_tokens=9)
    budget = plan.max_tokens_per_gpu
    assert budget == CPU_DEFAULT_TOKENS and "default budget" in plan.note and not plan.gradient_checkpointing
    config = run_config(cfg)
    assert config.steps.max_tokens_per_gpu is None and config.with_max_tokens(budget).steps.max_tokens_per_gpu == budget
    steps = config.with_max_tokens(budget).steps
    assert actor.train_step(synthetic_samples([8, 9]), steps).num_micro_batches == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_probe_on_gpu_fits(tiny_ckpt):
    """The probed budget is a multiple of 1024 and a micro-batch of that size trains."""
    cfg = tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="auto")
    actor = Actor(load_pretrained(tiny_ckpt), actor_config(cfg), init_distributed("cuda"))
    plan = plan_trainer_memory(actor, None, False, min_tokens=1024)
    budget = plan.max_tokens_per_gpu
    actor.model.gradient_checkpointing = plan.gradient_checkpointing
    assert budget % 1024 == 0 and budget >= 1024
    n = min(budget, 65536)
    m = actor.train_step(synthetic_samples([n // 2, n // 2]), run_config(cfg).with_max_tokens(budget).steps)
    assert m.num_micro_batches == 1 and math.isfinite(m.grad_norm)


def test_probe_measurement_runs_the_actor_loss_on_cpu(tiny_ckpt, monkeypatch):
    """The probe's micro-batch goes through the actor's own loss (its signature included) and backward;
    CUDA's memory counters are stood in for, so a change to the loss's arguments fails here, not only
    on a GPU (it once reached the device first: the probe called the loss without its slices)."""
    from furlong.trainer import memory_probe
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 12345)
    cfg = tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="auto")
    actor = Actor(load_pretrained(tiny_ckpt), actor_config(cfg), init_distributed("cpu"))
    assert memory_probe._measure(actor, 64) == 12345
    assert all(p.grad is None for p in actor.model.parameters())   # the probe leaves no gradients behind


def test_timed_probe_measures_with_gradients_held(tiny_ckpt, monkeypatch):
    """The measured probe run starts with every trained parameter's gradient held (as a step's later
    micro-batches run their forward), and frees them after: a probe measured without them planned an
    8B step that ran out of memory in its second micro-batch's forward."""
    from furlong.trainer import memory_probe
    cfg = tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="auto")
    actor = Actor(load_pretrained(tiny_ckpt), actor_config(cfg), init_distributed("cpu"))
    trained = [p for p in actor.model.parameters() if p.requires_grad]
    held_at_reset = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda *a, **k: held_at_reset.append(all(p.grad is not None for p in trained)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 777)
    peak, seconds = memory_probe._timed_probe(actor, 64)
    assert peak == 777 and seconds >= 0
    assert held_at_reset == [False, True, True]   # warm-up from none; both timed runs with gradients held
    assert all(p.grad is None for p in trained)
