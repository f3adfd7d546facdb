"""The bench workload files: each parses, and the model shapes are the published Qwen3 sizes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from furlong.bench.workload import load_workload
from furlong.models.decoder import Transformer
from furlong.models.hf_config import ModelArgs

BENCH = Path(__file__).resolve().parents[1] / "bench"

# Parameter counts of the published checkpoints (billions; Qwen3 model cards: total parameters).
PUBLISHED = {"seed_workload.json": 0.6, "qwen3_1p7b_workload.json": 1.7, "qwen3_4b_workload.json": 4.0,
             "qwen3_8b_workload.json": 8.2, "long_workload.json": 0.6, "long_rlstep_workload.json": 0.6,
             "long_prompt_workload.json": 0.6}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_workload_parses_and_has_the_published_size(name):
    w = load_workload(BENCH / name)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf_config(w.model))
    num_params = sum(p.numel() for p in model.parameters()) / 1e9
    assert num_params == pytest.approx(PUBLISHED[name], rel=0.08), num_params
    assert len(w.response_lens) == len(w.prompt_lens) * w.n_samples_per_prompt


def test_long_workload_is_the_seed_step_times_eight():
    seed, long = load_workload(BENCH / "seed_workload.json"), load_workload(BENCH / "long_workload.json")
    assert long.response_lens == [min(8 * r, 8192) for r in seed.response_lens]
    assert sum(long.response_lens) / len(long.response_lens) == pytest.approx(3664, abs=1)


def test_long_rlstep_workload_is_the_long_one_cut_to_16_prompts():
    long, cut = load_workload(BENCH / "long_workload.json"), load_workload(BENCH / "long_rlstep_workload.json")
    assert cut.prompt_lens == long.prompt_lens[:16] and cut.response_lens == long.response_lens[:16 * 8]
    assert cut.model == long.model and max(cut.response_lens) == 8192   # the tail is the long one's
    assert cut.rlstep_num_steps == 2 and cut.rlstep_over_sampling == 32 and cut.global_batch_size == 128


def test_long_prompt_workload_is_the_long_one_with_prompts_past_the_cascade_threshold():
    from furlong.engine.engine import EngineConfig
    long, lp = load_workload(BENCH / "long_workload.json"), load_workload(BENCH / "long_prompt_workload.json")
    assert lp.prompt_lens == [4 * p for p in long.prompt_lens] and lp.response_lens == long.response_lens
    assert lp.model == long.model and min(lp.prompt_lens) >= EngineConfig().cascade_min_prefix   # every prompt grouped
