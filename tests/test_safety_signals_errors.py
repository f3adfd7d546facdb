"""Nothing silent, no tracebacks: progress inside a rollout, the filter's give-up rule, SIGTERM outside the
RL loop, sys.exit / bad values in rewards, broken filters, unreadable data, out-of-range prepare sizes,
full-disk errors (issue 25, "Silence" and "Tracebacks and late errors")."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_helpers import one_line, run_cli, tiny_assets  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
FILTER = "furlong.rollout.filters.check_reward_nonzero_std"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("signal_assets"))


def train_argv(a: Path, out: Path, *extra: str, reward: str = "tests.rewards_for_tests.index_reward",
               data: str | None = None) -> list[str]:
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", data or str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", reward, "--num-rollout", "1", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6", "--device", "cpu",
            "--output-dir", str(out), *extra]




# ---------------------------------------------------------------- progress

def test_rollout_reports_progress_while_it_runs():
    from test_rollout import FakeDataset, FakeEngine, scripted_reward, spec
    from furlong.rollout.filters import load_filter
    from furlong.rollout.rollout import generate_rollout
    lines: list[str] = []
    generate_rollout(FakeDataset(20), FakeEngine(), scripted_reward, load_filter(FILTER), spec(4, 5), None, 2,
                     report=lines.append, report_every_s=0.0)
    assert lines and all(x.startswith("[rollout 3 generating]") for x in lines)
    assert lines[0].startswith("[rollout 3 generating] 0 samples done | groups kept 0/4, dropped 0, in flight 5")
    assert "4 samples done | groups kept 0/4, dropped 2" in lines[1] and "tok/s" in lines[1]   # step 2: rows 0, 4
    silent: list[str] = []
    generate_rollout(FakeDataset(20), FakeEngine(), scripted_reward, load_filter(FILTER), spec(4, 5), None, 0,
                     report=silent.append)           # the default 10 s: a fast rollout prints nothing
    assert silent == []


def test_give_up_rule_is_stated_at_start(assets, tmp_path, capsys):
    code, out, err = run_cli(train_argv(assets, tmp_path / "run", "--dynamic-sampling-filter-path", FILTER), capsys)
    assert code == 0, err
    assert "dynamic sampling filter zero_std: each rollout keeps 2 groups of 2; it gives up with an error when 8 " \
           "prompts" in out


# ---------------------------------------------------------------- signals

def test_sigterm_outside_a_step_is_one_line_and_143(monkeypatch, tmp_path, capsys):
    import furlong.tasks.synthetic as synthetic

    def killed(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt")
    monkeypatch.setattr(synthetic, "prepare_synthetic", killed)
    before = signal.getsignal(signal.SIGTERM)
    code, _, err = run_cli(["prepare", "synthetic", "--output", str(tmp_path / "d")], capsys)
    assert code == 143
    one_line(err, "stopped by signal 15 (SIGTERM)")
    assert signal.getsignal(signal.SIGTERM) == before       # handler restored


def test_sigterm_during_eval_real_process(assets, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "furlong", "eval", "--hf-checkpoint", str(assets / "ckpt"),
                        "--eval-prompt-data", "syn", str(assets / "data" / "test.parquet"), "--input-key", "messages",
                        "--label-key", "label", "--apply-chat-template", "--custom-rm-path",
                        "tests.rewards_for_safety.sigterm_reward", "--rollout-max-response-len", "4",
                        "--device", "cpu", "--output-dir", str(tmp_path / "out")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 143, p.stderr
    one_line(p.stderr, "stopped by signal 15")


def test_sigterm_during_sft_stops_after_the_step_and_saves(assets, tmp_path, capsys, monkeypatch):
    from furlong.trainer.actor import Actor
    real = Actor.train_step
    calls = []

    def step_then_term(self, batch, steps):
        out = real(self, batch, steps)
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    monkeypatch.setattr(Actor, "train_step", step_then_term)
    code, _, err = run_cli(["sft", "--hf-checkpoint", str(assets / "ckpt"), "--prompt-data",
                            str(assets / "data" / "sft.parquet"), "--global-batch-size", "1", "--device", "cpu",
                            "--output-dir", str(tmp_path / "run"), "--save", str(tmp_path / "hf")], capsys)
    assert code == 143
    one_line(err, "sft stopped by signal 15 after step 2/8", str(tmp_path / "hf"))
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "hf" / "model.safetensors").is_file()


# ---------------------------------------------------------------- user code

@pytest.mark.parametrize("fn,needles", [
    ("exit_reward", ["reward function exit_reward called sys.exit(3) on sample (group"]),
    ("huge_reward", ["reward function huge_reward returned", "OverflowError"]),
    ("none_reward", ["reward function none_reward returned NoneType", "not a number"]),
])
def test_misbehaving_reward_is_one_line_naming_it(assets, tmp_path, capsys, fn, needles):
    code, _, err = run_cli(train_argv(assets, tmp_path / "run", reward=f"tests.rewards_for_safety.{fn}"), capsys)
    assert code == 1
    one_line(err, *needles)


def test_broken_filters_are_one_line(assets, tmp_path, capsys):
    code, _, err = run_cli(train_argv(assets, tmp_path / "a", "--dynamic-sampling-filter-path",
                                      "tests.rewards_for_safety.miles_filter"), capsys)
    assert code == 2
    one_line(err, "--dynamic-sampling-filter-path", "one positional argument")
    assert not (tmp_path / "a").exists()
    code, _, err = run_cli(train_argv(assets, tmp_path / "b", "--dynamic-sampling-filter-path",
                                      "tests.rewards_for_safety.boom_filter"), capsys)
    assert code == 1
    one_line(err, "filter boom_filter raised KeyError", "on group 0")


# ---------------------------------------------------------------- data and sizes

def test_unreadable_prompt_data_names_the_file(assets, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "1+1"}], "label": "2"})
    bad.write_bytes(good.encode() + b"\n" + b'{"messages": "\xff\xfe"}\n')
    code, _, err = run_cli(train_argv(assets, tmp_path / "o1", data=str(bad)), capsys)
    assert code == 2
    one_line(err, "bad.jsonl", "line 2", "not UTF-8")
    code, _, err = run_cli(train_argv(assets, tmp_path / "o2", data=str(tmp_path)), capsys)
    assert code == 2
    one_line(err, "is a directory")
    null = tmp_path / "null.jsonl"
    null.write_text(good + "\n" + json.dumps({"messages": [{"role": "user", "content": "x"}], "label": None}) + "\n")
    code, _, err = run_cli(train_argv(assets, tmp_path / "o3", data=str(null)), capsys)
    assert code == 2
    one_line(err, "null.jsonl: row 2", "label key 'label' is null")


def test_prepare_synthetic_bounds_its_sizes(tmp_path, capsys):
    code, _, err = run_cli(["prepare", "synthetic", "--output", str(tmp_path / "d"), "--num-train",
                            "100000000000"], capsys)
    assert code == 2
    one_line(err, "--num-train", "must be in [1, 10000000]")
    assert not (tmp_path / "d").exists()


def test_full_disk_is_a_run_failure_line_not_a_traceback():
    from furlong.launch.entry import error_line, exit_code_for
    e = OSError(errno.ENOSPC, "No space left on device", "/data/run/samples/x.jsonl")
    assert exit_code_for(e) == 1
    assert "No space left on device" in error_line(e) and "x.jsonl" in error_line(e)
    assert exit_code_for(OSError(errno.EROFS, "Read-only file system")) == 1
    assert exit_code_for(OSError(errno.EBADF, "bug")) is None        # anything else keeps its traceback
