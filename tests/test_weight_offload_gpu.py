"""--offload-rollout-level weight on CUDA (skipped without it): the arena is a StableBuffer, so its release
gives the driver the weights' memory, and after restore + weight sync the engine replays the CUDA graphs
it captured before (none captured again) and samples the same greedy tokens."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from tiny_checkpoints import write_tiny_checkpoint

from furlong.engine import Engine, EngineConfig, Request, SamplingParams
from furlong.models.hf_io import load_pretrained
from furlong.run import step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_released_weights_go_to_the_driver_and_graphs_survive(tmp_path):
    path = str(write_tiny_checkpoint(tmp_path / "ckpt", family="qwen3", vocab_size=4096, hidden=512, layers=4,
                                     heads=8, kv_heads=4, seed=0))
    tok = AutoTokenizer.from_pretrained(path)
    model = load_pretrained(path, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, tok, [2], EngineConfig(max_num_seqs=16, max_model_len=256, kv_fraction=0.05,
                                                  offload_weights=True))
    trainer = load_pretrained(path, dtype=torch.float32, device="cuda")     # stands in for the actor
    assert engine.runner.weights.stable
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    prompts = [[5, 9, 17, 300], [44, 3], [7, 7, 8, 100, 3, 1000]]

    def greedy():
        out = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
        engine.release()
        return [c[0].token_ids for c in out]

    before = greedy()
    graphs = dict(engine.runner.graphs)
    assert graphs
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    engine.release_weights()
    free1, _ = torch.cuda.mem_get_info()
    arena_bytes = engine.runner.weights.max_bytes
    assert free1 - free0 >= arena_bytes * 0.99
    step.update_engine_weights(trainer, engine, 1 << 24)
    assert greedy() == before
    assert engine.runner.graphs == graphs          # the same graph objects, replayed over the restored weights
