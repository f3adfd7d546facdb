"""bench/multiturn.py --tiny on the CPU: every variant generates the same tokens, the multi-turn run
prefills only what each turn adds (the rest comes from retained KV)."""
from __future__ import annotations

import importlib.util
from pathlib import Path


def test_multiturn_bench_tiny(tmp_path):
    path = Path(__file__).resolve().parents[1] / "bench" / "multiturn.py"
    spec = importlib.util.spec_from_file_location("bench_multiturn", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--tiny", "--output", str(tmp_path / "r.json")])
    total = out["num_generated_tokens"]
    assert out["single_engine_generated_tokens"] == out["single_front_generated_tokens"] == total
    assert out["multi_turn_generated_tokens"] == total
    # a prompt's n first turns share one prefill (scheduler.py, shared prompts), as the n-sample requests
    # of single_engine do; each later turn prefills its tool tokens plus the previous turn's last token
    prompts = 9 + 13 + 7 + 11
    assert out["single_engine_prefill_tokens"] == out["single_front_prefill_tokens"] == prompts
    assert out["multi_turn_prefill_tokens"] == prompts + 2 * out["num_samples"] * (out["tool_len"] + 1)
    assert out["multi_turn_cached_tokens"] > 0 and out["ratio_vs_single_engine"] > 0
    assert (tmp_path / "r.json").is_file()
