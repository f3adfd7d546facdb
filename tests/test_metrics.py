"""Run outputs: metrics.jsonl lines, TensorBoard events, the progress line, wandb errors."""
import io
import json

import pytest

from furlong.run.metrics import MetricsLogger, format_duration, progress_line


def test_jsonl_and_tensorboard(tmp_path):
    log = MetricsLogger(tmp_path, use_tensorboard=True, stream=io.StringIO())
    log.log(0, {"rollout/raw_reward": 0.5, "train/loss": -0.1})
    log.log(1, {"rollout/raw_reward": 0.75}, kind="eval")
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"kind": "rollout", "step": 0, "rollout/raw_reward": 0.5, "train/loss": -0.1},
                    {"kind": "eval", "step": 1, "rollout/raw_reward": 0.75}]
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("rollout/raw_reward")] == [0.5, 0.75]


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(tmp_path / "out", enabled=False)
    log.log(0, {"a": 1.0})
    log.close()
    assert not (tmp_path / "out").exists()


def test_progress_line_has_step_reward_eval_rate_eta():
    line = progress_line(2, 60, {"rollout/raw_reward": 0.25, "eval/gsm8k": 0.7, "perf/rollout_tok_per_s": 12345.0,
                                 "perf/step_time": 30.0}, eta_s=1710)
    assert line.startswith("[rollout 3/60]")
    for part in ("reward 0.250", "eval/gsm8k 0.700", "gen 12.3k tok/s", "step 30.0s", "ETA 28m30s"):
        assert part in line, line
    assert format_duration(float("inf")) == "?"


def test_wandb_missing_names_the_flag(tmp_path, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ValueError, match="--use-wandb"):
        MetricsLogger(tmp_path, wandb_settings={"project": "p"})


def test_non_finite_metrics_are_written_as_null(tmp_path):
    import json as _json
    from furlong.run.metrics import MetricsLogger
    log = MetricsLogger(tmp_path)
    log.log(0, {"a": float("nan"), "b": float("inf"), "c": 1.5})
    log.close()
    row = _json.loads((tmp_path / "metrics.jsonl").read_text())     # strict JSON parses
    assert row["a"] is None and row["b"] is None and row["c"] == 1.5
