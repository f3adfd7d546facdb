"""The bench's `trl` part on the CPU at tiny scale: TRL's GRPOTrainer and furlong's whole step at one
fixed response length, same run. Needs trl and datasets (not furlong dependencies: skipped without)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bench import one_thread, tiny_workload, write  # noqa: E402,F401 (one_thread: fixture)

from furlong import bench  # noqa: E402
from furlong.bench import trl_part  # noqa: E402
from furlong.bench.trl_part import word_tokenizer  # noqa: E402


def trl_workload() -> dict:
    """4 prompts x 2 samples, vocab 512, mean response length 8; TRL: 2 micro-batches of 4, 1 + 1 steps."""
    w = tiny_workload(global_batch_size=8, max_tokens_per_gpu=64)
    w["model"]["vocab_size"] = 512
    w["rollout"].update(prompt_lens=[5, 9, 7, 6], response_lens=[3, 11, 6, 10, 8, 12, 9, 5])
    w["trl_probe"] = {"micro_batch_size": 4, "warmup_steps": 1, "timed_steps": 1}
    return w


def test_word_tokenizer_is_one_token_per_word():
    tok = word_tokenizer(512)
    assert tok("t5 t17 t510")["input_ids"] == [5, 17, 510]
    assert (tok.eos_token_id, tok.pad_token_id) == (511, 510)
    assert tok.decode([5, 17, 511], skip_special_tokens=True) == "t5 t17"


def test_trl_part_times_both_steps_at_one_length(tmp_path, capsys):
    w = trl_workload()
    out = tmp_path / "bench.json"
    assert bench.run_bench(str(write(tmp_path, w)), str(out), "trl") == 0, capsys.readouterr().out[-3000:]
    res = json.loads(out.read_text())
    part = res["parts"]["trl"]
    assert part["status"] == "ok", part["error"]
    r = part["result"]
    assert r["response_len"] == 8 and "8 tokens on both sides" in r["note"]
    assert r["num_samples"] == 8 and r["gradient_accumulation_steps"] == 2
    assert r["num_tokens"] == sum(w["rollout"]["prompt_lens"]) * 2 + 8 * 8
    assert len(r["trl_steps_s"]) == 2 and r["timed_steps"] == 1
    assert r["trl_step_s"] == r["trl_steps_s"][1] > 0
    assert r["furlong_step_s"] > 0 and r["furlong_log_probs_s"] == 0.0   # one optimizer step: log-probs reused
    assert r["furlong_step_s"] == pytest.approx(r["furlong_rollout_s"] + r["furlong_train_step_s"]
                                                + r["furlong_weight_sync_s"])
    assert r["furlong_over_trl"] == pytest.approx(r["trl_step_s"] / r["furlong_step_s"])
    assert res["step"]["furlong_over_trl"] == r["furlong_over_trl"]
    assert res["step"]["whole_step_s"] is None                          # the rollout and train parts did not run
    assert "furlong_over_trl" in capsys.readouterr().out


def test_trl_probe_must_divide_the_step(tmp_path):
    w = trl_workload()
    w["trl_probe"]["micro_batch_size"] = 3
    with pytest.raises(ValueError, match="trl_probe.micro_batch_size"):
        bench.load_workload(write(tmp_path, w))


def cut_after(steps: int, monkeypatch) -> None:
    """The part's guard fires (PartTimeout) right after TRL's `steps`-th step."""
    real = trl_part._step_timer

    def timer_that_times_out(device):
        timer = real(device)
        end = timer.on_step_end

        def on_step_end(*args, **kwargs):
            end(*args, **kwargs)
            if len(timer.seconds) == steps:
                raise bench.PartTimeout("time guard of 1 s reached")

        timer.on_step_end = on_step_end   # the callback handler looks events up on the instance
        return timer

    monkeypatch.setattr(trl_part, "_step_timer", timer_that_times_out)


def test_a_guard_after_the_warmups_keeps_the_timed_steps_done(tmp_path, monkeypatch):
    w = trl_workload()
    w["trl_probe"]["timed_steps"] = 3
    cut_after(2, monkeypatch)
    out = tmp_path / "bench.json"
    assert bench.run_bench(str(write(tmp_path, w)), str(out), "trl") == 0
    r = json.loads(out.read_text())["parts"]["trl"]["result"]
    assert r["timed_steps"] == 1 and len(r["trl_steps_s"]) == 2
    assert "stopped TRL after 2 of 4 steps" in r["note"]


def test_a_guard_during_the_warmups_is_a_timeout(tmp_path, monkeypatch):
    cut_after(1, monkeypatch)
    out = tmp_path / "bench.json"
    assert bench.run_bench(str(write(tmp_path, trl_workload())), str(out), "trl") == 1
    assert json.loads(out.read_text())["parts"]["trl"]["status"] == "timeout"
