"""LoRA on CUDA: the bf16 engine on merged weights vs the trainer's base + adapters (skipped without CUDA)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_actor import synthetic_samples, tiny_config, train_rollout  # noqa: E402
from test_lora_training import LENGTHS, LORA  # noqa: E402

from furlong.launch.distributed import init_distributed  # noqa: E402
from furlong.models.hf_io import load_pretrained  # noqa: E402
from furlong.config_map import actor_config, batching_config  # noqa: E402
from furlong.trainer.actor import Actor  # noqa: E402
from furlong.trainer.weight_sync import sync_weights  # noqa: E402


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_vs_trainer_log_prob_gap_lora_bf16(tmp_path):
    """The merged weights in the bf16 engine vs the trainer's base + adapters: the mean |log-prob gap|
    of sampled tokens stays as small as for full weights (both measured here, both <= 0.01)."""
    from test_engine_gpu import NullTok
    from tiny_checkpoints import write_tiny_checkpoint
    from furlong.engine import Engine, EngineConfig, Request, SamplingParams
    from furlong.types import TrainSample
    ckpt = write_tiny_checkpoint(tmp_path / "c", vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2,
                                 tie=False, init_std=0.05)
    ctx = init_distributed("auto")
    gaps = {}
    for name, flags, base_dtype in (("full", {}, torch.float32), ("lora", LORA, torch.bfloat16)):
        cfg = tiny_config(lr=1e-2, torch_compile="off", **flags)
        actor = Actor(load_pretrained(ckpt, dtype=base_dtype, device=ctx.device), actor_config(cfg), ctx)
        for _ in range(3):
            train_rollout(actor, cfg, synthetic_samples(LENGTHS))
        eng = Engine(load_pretrained(ckpt, dtype=torch.bfloat16, device=ctx.device), NullTok(), [],
                     EngineConfig(max_model_len=256, max_num_seqs=16, kv_fraction=0.02))
        sync_weights(actor.model, eng.model, bucket_bytes=1 << 16)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 17, 30)]
        with torch.inference_mode():
            out = eng.generate([Request(i, p, SamplingParams(temperature=1.0, max_new_tokens=100, ignore_eos=True),
                                        n=4, seed=i) for i, p in enumerate(prompts)])
        eng.release()
        samples, engine_lp = [], []
        for p, comps in zip(prompts, out):
            for c in comps:
                r = len(c.token_ids)
                samples.append(TrainSample(token_ids=torch.tensor(p + c.token_ids), num_prompt_tokens=len(p),
                                           advantages=torch.zeros(r), rollout_log_probs=torch.tensor(c.log_probs)))
                engine_lp.append(torch.tensor(c.log_probs))
        trainer_lp = actor.compute_log_probs(samples, batching_config(cfg), "old")
        gaps[name] = torch.cat([(a - b).abs() for a, b in zip(trainer_lp, engine_lp)]).mean().item()
    print(f"engine-vs-trainer mean |log-prob gap| (bf16): full {gaps['full']:.5f}, lora {gaps['lora']:.5f}")
    assert gaps["lora"] <= max(1.5 * gaps["full"], 2e-3) and gaps["lora"] <= 0.01, gaps
