"""`furlong bench` on the CPU at tiny scale: every part runs, the numbers are consistent
with the workload, failures and timeouts are reported per part, and the HF baseline
holds exactly our weights."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from furlong import bench
from furlong.models.decoder import Transformer
from furlong.models.hf_config import ModelArgs
from furlong.trainer.planning import plan_micro_batches

SEED_WORKLOAD = Path(__file__).resolve().parents[1] / "bench" / "seed_workload.json"

TINY_MODEL = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 512, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
}


def tiny_workload(**train_overrides) -> dict:
    """The seed workload's schema with a tiny model, 3 prompts x 2 samples and short lengths."""
    train = {"global_batch_size": 6, "use_dynamic_batch_size": True, "max_tokens_per_gpu": 40, "optimizer": "adam",
             "lr": 1e-6, "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.98, "eps_clip": 0.2,
             "eps_clip_high": 0.28, "update_weight_buffer_size": 4096, "budget_sweep": [20, 1000]}
    train.update(train_overrides)
    return {
        "name": "tiny", "about": "test", "model": dict(TINY_MODEL),
        "rollout": {"n_samples_per_prompt": 2, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                    "max_response_len": 16, "prompt_lens": [5, 9, 7], "response_lens": [3, 11, 6, 4, 1, 8]},
        "train": train,
        "decode_probe": {"about": "test", "batch": 4, "prompt_len": 8, "new_tokens": 12},
        "eval_probe": {"num_prompts": 5, "max_new_tokens": 6},
    }


@pytest.fixture(autouse=True)
def one_thread():
    # The CI box has 2 cores shared with other jobs; more threads than that make tiny ops crawl.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def write(tmp_path: Path, workload: dict) -> Path:
    p = tmp_path / "workload.json"
    p.write_text(json.dumps(workload))
    return p


def test_all_parts_run_and_agree_with_the_workload(tmp_path, capsys):
    w = tiny_workload()
    out = tmp_path / "res" / "bench.json"
    names = [p for p in bench.PART_ORDER if p != "trl"]   # trl needs TRL installed: tests/test_bench_trl.py
    assert bench.run_bench(str(write(tmp_path, w)), str(out), ",".join(names)) == 0
    res = json.loads(out.read_text())
    parts = res["parts"]
    assert list(parts) == names
    assert all(p["status"] == "ok" for p in parts.values()), {k: p["error"] for k, p in parts.items()}
    prompt_lens, resp = w["rollout"]["prompt_lens"], w["rollout"]["response_lens"]
    lengths = [prompt_lens[i // 2] + r for i, r in enumerate(resp)]

    tr = parts["train"]["result"]
    assert tr["num_tokens"] == sum(lengths) and tr["num_samples"] == 6
    assert tr["num_micro_batches"] == len(plan_micro_batches(lengths, 40)) == 2
    assert tr["micro_batch_max_tokens"] <= 40 and tr["micro_batch_imbalance"] >= 1.0
    assert tr["mbs1_num_micro_batches"] == 6
    assert tr["reuses_old_log_probs"] is True            # one optimizer step: the loop skips the extra forward
    assert tr["weight_sync_note"] == "ok" and tr["weight_sync_s"] > 0
    params = sum(p.numel() for p in Transformer(ModelArgs.from_hf_config(TINY_MODEL)).parameters())
    assert tr["weight_sync_gib"] == pytest.approx(params * 4 / 2**30)   # fp32 engine on CPU
    assert tr["log_probs_peak_gib"] is None              # no memory stats on CPU
    assert len(tr["train_step_s_all"]) == 3 and tr["train_step_s"] == sorted(tr["train_step_s_all"])[1]

    budget = parts["budget"]["result"]
    assert budget["auto_max_tokens"] == 16384 and "default budget" in budget["auto_note"]   # the plan's, on CPU
    rows = budget["rows"]
    assert [r["max_tokens_per_gpu"] for r in rows] == [20, 1000]
    assert [r["num_micro_batches"] for r in rows] == [len(plan_micro_batches(lengths, 20)), 1]
    assert all(r["train_status"] == "ok" and r["log_probs_status"] == "ok" for r in rows)

    hf = parts["hf"]["result"]
    assert hf["num_real_tokens"] == sum(lengths)
    assert hf["num_padded_tokens"] >= sum(lengths)
    assert hf["num_micro_batches"] == len(bench.hf_micro_batches(lengths, 40))
    assert hf["furlong_over_hf"] == pytest.approx(tr["train_tok_per_s"] / hf["tok_per_s"])

    ro = parts["rollout"]["result"]
    assert ro["num_forced_tokens"] == sum(resp) and ro["max_new_tokens"] == max(resp)
    assert ro["tok_per_s"] == pytest.approx(sum(resp) / ro["seconds"])
    assert ro["first_seconds"] > 0 and ro["kv_cache_gib"] > 0
    # continuous batching: rows leave at their own length, so the mean batch is below 6
    assert ro["decode_steps"] >= max(resp) - 1 and ro["mean_running_batch"] < 6
    assert ro["cascade_row_fraction"] == 0 and ro["no_cascade_seconds"] is None   # prompts below 256 tokens

    ev = parts["eval"]["result"]
    assert ev["num_prompts"] == 5 and ev["num_generated_tokens"] == 5 * 6

    de = parts["decode"]["result"]
    assert de["hf_new_tokens"] == de["new_tokens"] == 12
    assert de["furlong_over_hf"] == pytest.approx(de["furlong_tok_per_s"] / de["hf_tok_per_s"])

    ref = parts["ref"]["result"]
    assert [r["placement"] for r in ref["rows"]] == ["gpu", "cpu"] and ref["gib_saved"] is None   # no CUDA
    assert ref["cpu_minus_gpu_s"] == pytest.approx(ref["rows"][1]["pass_s"] - ref["rows"][0]["pass_s"])
    assert all(len(r["pass_s_all"]) == 3 and r["pass_s"] > 0 for r in ref["rows"])

    step = res["step"]
    assert step["whole_step_s"] == pytest.approx(step["rollout_s"] + step["train_step_s"] + step["weight_sync_s"])
    assert step["log_probs_s"] == 0.0
    table = capsys.readouterr().out
    for needle in ("whole_step_s", "max_tokens=20", "furlong_over_hf", "auto_max_tokens"):
        assert needle in table


def test_failed_and_timed_out_parts_are_reported(tmp_path, monkeypatch):
    def boom(b):
        raise RuntimeError("engine exploded")

    def slow(b):
        raise bench.PartTimeout("time guard of 1 s reached")

    monkeypatch.setitem(bench.PARTS, "rollout", boom)
    monkeypatch.setitem(bench.PARTS, "train", slow)
    out = tmp_path / "bench.json"
    assert bench.run_bench(str(write(tmp_path, tiny_workload())), str(out), "rollout,train,decode") == 1
    parts = json.loads(out.read_text())["parts"]
    assert list(parts) == ["train", "rollout", "decode"]          # run order, not argument order
    assert parts["train"]["status"] == "timeout"
    assert parts["rollout"]["status"] == "error" and "engine exploded" in parts["rollout"]["error"]
    assert parts["decode"]["status"] == "ok"                      # later parts still run
    assert json.loads(out.read_text())["step"]["whole_step_s"] is None


def test_trl_part_without_trl_fails_at_once_with_the_install_hint(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "trl", None)   # None in sys.modules: `import trl` raises ImportError
    out = tmp_path / "bench.json"
    assert bench.run_bench(str(write(tmp_path, tiny_workload())), str(out), "trl") == 1
    part = json.loads(out.read_text())["parts"]["trl"]
    assert part["status"] == "error" and "trl part: pip install trl datasets" in part["error"]
    assert part["seconds"] < 5                                  # before furlong's side of the comparison


def test_time_guard_interrupts_python_loop():
    t = time.perf_counter()
    with pytest.raises(bench.PartTimeout):
        with bench.time_guard(0.2):
            while True:
                time.sleep(0.01)
    assert time.perf_counter() - t < 2
    with bench.time_guard(5):   # disarmed on exit: nothing fires later
        pass
    time.sleep(0.05)


def test_hf_model_holds_our_weights():
    torch.manual_seed(0)
    ours = Transformer(ModelArgs.from_hf_config(TINY_MODEL)).eval()
    hf = bench.build_hf_model(ours, TINY_MODEL, torch.float32, torch.device("cpu")).eval()
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, ours(ids), atol=1e-5, rtol=1e-5)


def test_hf_micro_batches_respect_the_padded_budget():
    lengths = [30, 5, 12, 12, 50, 7, 9, 30, 1]
    plan = bench.hf_micro_batches(lengths, 40)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        width = max(lengths[i] for i in mb)
        assert lengths[mb[0]] == width                           # longest first: it sets the padding
        assert len(mb) * width <= 40 or len(mb) == 1             # a 50-token sample sits alone
    assert [4] in plan


def test_workload_errors_name_the_key(tmp_path):
    w = tiny_workload()
    w["rollout"]["response_lens"] = w["rollout"]["response_lens"][:-1]
    with pytest.raises(ValueError, match="rollout.response_lens"):
        bench.load_workload(write(tmp_path, w))
    w = tiny_workload()
    del w["train"]["max_tokens_per_gpu"]
    with pytest.raises(ValueError, match="train.max_tokens_per_gpu"):
        bench.load_workload(write(tmp_path, w))
    w = tiny_workload()
    w["model"]["model_type"] = "gpt2"
    with pytest.raises(ValueError, match="model_type"):
        bench.load_workload(write(tmp_path, w))
    with pytest.raises(ValueError, match="--workload"):
        bench.load_workload(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="--parts"):
        bench.parse_parts("train,warp")
    assert bench.parse_parts("decode, train") == ["train", "decode"]


def test_seed_workload_in_repo_parses():
    w = bench.load_workload(SEED_WORKLOAD)
    assert w.num_samples == 256 and len(w.prompt_lens) == 32
    assert w.max_tokens_per_gpu == 32768 and w.budgets == bench.DEFAULT_BUDGETS
    assert (w.decode_batch, w.decode_prompt_len, w.decode_new_tokens) == (256, 128, 512)
    assert (w.trl_micro_batch_size, w.trl_warmup_steps, w.trl_timed_steps) == (16, 2, 3)   # 16 x 16 = 256
    # 141,730 tokens at 32,768 per micro-batch: 5 micro-batches on one GPU
    assert len(plan_micro_batches(w.sample_lengths(), w.max_tokens_per_gpu)) == 5


def test_first_micro_batch_is_the_samples_that_fit_in_order():
    w = bench.load_workload(SEED_WORKLOAD)
    mb = w.first_micro_batch(32768)
    lengths = w.sample_lengths()
    assert [p + r for p, r in mb] == lengths[:len(mb)]
    assert sum(lengths[:len(mb)]) <= 32768 < sum(lengths[:len(mb) + 1])
    assert mb[0] == (w.prompt_lens[0], w.response_lens[0])


def test_median_ms_times_each_call_after_a_warm_up():
    from furlong.bench.measure import median_ms
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.01 * len(calls))      # 10, 20, 30, 40 ms: the warm-up (10 ms) is not counted
    ms = median_ms(fn, torch.device("cpu"), 3)
    assert len(calls) == 4 and 28 <= ms < 39


def test_rollout_part_times_cascade_on_and_off_when_rows_share_prompts(tmp_path, monkeypatch):
    """With groups formed (the threshold lowered for the tiny prompts), the rollout part reports the
    grouped fraction and times the same rollout with cascade off."""
    from furlong.bench import generation_parts
    make = generation_parts.make_engine

    def grouped(*a, **kw):
        engine = make(*a, **kw)
        engine.runner.cascade_min_prefix = 1
        return engine
    monkeypatch.setattr(generation_parts, "make_engine", grouped)
    out = tmp_path / "bench.json"
    assert bench.run_bench(str(write(tmp_path, tiny_workload())), str(out), "rollout") == 0
    ro = json.loads(out.read_text())["parts"]["rollout"]["result"]
    assert 0 < ro["cascade_row_fraction"] <= 1 and ro["no_cascade_seconds"] > 0


def test_bench_reshard_flag_reaches_the_actor(tmp_path, monkeypatch):
    """`furlong bench --fsdp-reshard-after-forward --offload-rollout-level kv_cache weight` (what lets Qwen3-8B
    full-parameter fit beside its fp32 state on an 80 GB card): the actor's config carries the one, the
    bench the other, and the train row reports both."""
    from furlong import cli
    from furlong.trainer import actor as actor_mod
    seen = []
    real = actor_mod.Actor.__init__

    def spy(self, model, cfg, ctx, *a, **k):
        seen.append(cfg.shard.reshard_after_forward)
        real(self, model, cfg, ctx, *a, **k)
    monkeypatch.setattr(actor_mod.Actor, "__init__", spy)
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--workload", str(write(tmp_path, tiny_workload())), "--output", str(out),
                     "--parts", "train", "--fsdp-reshard-after-forward", "--offload-rollout-level", "kv_cache",
                     "weight"]) == 0
    assert seen == [True]
    train = json.loads(out.read_text())["parts"]["train"]["result"]
    assert train["reshard_after_forward"] is True and train["offload_weights"] is True
