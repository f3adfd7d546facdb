"""Fault injection on the CPU: `python -m furlong train` killed with SIGKILL before, during and right
after a checkpoint, then resumed with --load; a damaged latest checkpoint; SIGINT during a save; and a
table of bad inputs, each one stderr line and no files written (docs/design.md §7, §8).

The kills use the FURLONG_CKPT_FAULT hook of furlong/checkpoint/store.py: a save takes milliseconds on
the tiny model, so no outside polling can land between, say, the rename of iter_N and the tracker
update; the hook SIGKILLs the process exactly there. Resumes and most bad inputs run in-process
(`furlong.cli.main`) to keep interpreter start-ups few; the killed runs and one error run are real
processes.

Covered elsewhere and not repeated: SIGINT/SIGTERM between steps (test_e2e.py::test_sigint_*), --overwrite
(test_e2e.py::test_used_output_dir_is_refused_without_load_or_overwrite), config.json that is a list or
has a bad or string-typed value (test_cli.py::test_bad_config_json_is_one_line_naming_the_key), --output-dir
or --save under a file (test_cli.py BAD_INPUTS), and reward functions that raise, hang or return NaN, exit 1
(test_e2e.py::test_broken_reward_stops_in_one_line).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

from furlong.cli import main  # noqa: E402
from furlong.checkpoint.store import FAULT_ENV, SLEEP_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # so --custom-rm-path tests.rewards_for_tests.* imports in-process
    sys.path.insert(0, str(ROOT))
NUM_ROLLOUT = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from furlong.tasks.synthetic import prepare_synthetic
    d = tmp_path_factory.mktemp("fault_assets")
    write_tiny_checkpoint(d / "ckpt", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1)
    prepare_synthetic(d / "data", 16, 2, 0)
    return d


def train_argv(a: Path, out: Path, *extra: str, num_rollout: int = NUM_ROLLOUT) -> list[str]:
    # hash_reward varies within groups, so every step has non-zero advantages and moves the weights
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template", "--rollout-shuffle",
            "--custom-rm-path", "tests.rewards_for_tests.hash_reward", "--num-rollout", str(num_rollout),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
            "--lr", "1e-2", "--device", "cpu", "--output-dir", str(out), *extra]


def env_with(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, SLEEP_ENV)}
    return {**env, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1", **extra}


def run_proc(argv: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "furlong", *argv], cwd=ROOT, env=env_with(**env),
                          capture_output=True, text=True, timeout=timeout)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(argv)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def non_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("perf/", "memory/"))}


def tracker(ck: Path) -> int:
    return int((ck / "latest_checkpointed_iteration.txt").read_text())


def assert_one_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"


@pytest.fixture(scope="module")
def baseline(assets, tmp_path_factory):
    """The uninterrupted run every fault run must reproduce: its metrics and a checkpoint per rollout."""
    d = tmp_path_factory.mktemp("baseline")
    assert main(train_argv(assets, d / "run", "--save", str(d / "ck"), "--save-interval", "1")) == 0
    steps = rows(d / "run")
    assert [r["step"] for r in steps] == list(range(NUM_ROLLOUT))
    # the weights move, so a resume that lost the model or optimizer state would show in these metrics
    assert steps[0]["rollout/rollout_log_probs"] != steps[-1]["rollout/rollout_log_probs"]
    return d / "run", d / "ck", steps


# (fault point:iteration, --save-interval, metrics steps and the newest iter_* entry on disk after the
# kill); the tracker is at 2 after each. With --save-interval 2 the save of iteration 3 is the final save.
KILLS = {
    "before a save": ("before_save:3", "1", [0, 1, 2], "iter_0000002"),   # step 3 logged, its save not begun
    "mid-save": ("mid_save:3", "2", [0, 1, 2], "iter_0000003.tmp"),       # shards written, not renamed
    "before the tracker": ("before_tracker:3", "1", [0, 1, 2], "iter_0000003"),   # renamed, tracker not moved
    "right after a save": ("after_save:2", "2", [0, 1], "iter_0000002"),
}


@pytest.mark.parametrize("case", list(KILLS))
def test_kill_9_then_resume_logs_every_step_once_and_matches(assets, baseline, tmp_path, capsys, case):
    fault, interval, want_steps, newest = KILLS[case]
    out, ck = tmp_path / "run", tmp_path / "ck"
    argv = train_argv(assets, out, "--save", str(ck), "--save-interval", interval)
    killed = run_proc(argv, **{FAULT_ENV: fault})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert tracker(ck) == 2 and sorted(p.name for p in ck.glob("iter_*"))[-1] == newest
    assert [r["step"] for r in rows(out)] == want_steps

    if case == "before a save":   # the same command again, without --load, must not touch the killed run
        before = (out / "metrics.jsonl").read_text()
        code, _, err = run_cli(argv, capsys)
        assert code == 2
        assert_one_line(err, "--output-dir", "already holds a run")
        assert (out / "metrics.jsonl").read_text() == before

    code, printed, err = run_cli(argv + ["--load", str(ck)], capsys)
    assert code == 0, err
    assert "resumed from iteration 2" in printed
    got = rows(out)
    assert [r["step"] for r in got] == list(range(NUM_ROLLOUT))
    for r, want in zip(got, baseline[2]):
        assert non_timing(r) == non_timing(want), r["step"]
    assert tracker(ck) == NUM_ROLLOUT and not list(ck.glob("*.tmp"))
    # same model and optimizer state, byte for byte, as the uninterrupted run's last checkpoint
    final = ck / f"iter_{NUM_ROLLOUT:07d}"
    for shard in sorted(final.glob("*.distcp")):
        assert shard.read_bytes() == (baseline[1] / final.name / shard.name).read_bytes(), shard.name


def _damage_truncate(it: Path) -> None:
    shard = next(it.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


DAMAGE = {
    "truncated shard": (_damage_truncate, "is truncated"),
    "no .metadata": (lambda it: (it / ".metadata").unlink(), ".metadata is missing"),
    "garbage trainer.pt": (lambda it: (it / "trainer.pt").write_bytes(b"not a pickle"), "trainer.pt is unreadable"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_latest_checkpoint_names_the_previous_one(assets, baseline, tmp_path, capsys, case):
    damage_fn, why = DAMAGE[case]
    ck, out = tmp_path / "ck", tmp_path / "run"
    shutil.copytree(baseline[1], ck)
    damage_fn(ck / "iter_0000003")
    argv = train_argv(assets, out, "--load", str(ck))
    if case == "truncated shard":   # once as a real process: exit code and stderr as a user sees them
        p = run_proc(argv)
        code, err = p.returncode, p.stderr
    else:
        code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert_one_line(err, "--load", str(ck / "iter_0000003"), why, str(ck / "iter_0000002"), "--ckpt-step 2")
    assert not out.exists()
    if case == "truncated shard":   # the flag the message names works, and continues exactly
        code, printed, err = run_cli(argv + ["--ckpt-step", "2"], capsys)
        assert code == 0, err
        assert "resumed from iteration 2" in printed
        assert [non_timing(r) for r in rows(out)] == [non_timing(baseline[2][2])]


def test_sigint_during_a_save_finishes_it_then_stops(assets, tmp_path):
    out, ck = tmp_path / "run", tmp_path / "ck"
    argv = train_argv(assets, out, "--save", str(ck), "--save-interval", "1")
    proc = subprocess.Popen([sys.executable, "-m", "furlong", *argv], cwd=ROOT, env=env_with(**{SLEEP_ENV: "3"}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marker = ck / "iter_0000001.tmp" / "trainer.pt"   # written just before the mid-save sleep
    deadline = time.time() + 120
    while not marker.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stderr and not stderr.strip(), stderr
    assert [ln for ln in stdout.splitlines() if "stopped by signal" in ln] == [
        f"furlong: stopped by signal {int(signal.SIGINT)} after rollout 1/{NUM_ROLLOUT}; resume with --load {ck}"]
    assert tracker(ck) == 1 and (ck / "iter_0000001" / ".metadata").is_file() and not list(ck.glob("*.tmp"))
    assert [r["step"] for r in rows(out)] == [0]


# ---------------------------------------------------------------- bad inputs: exit 2, one line, nothing written

def _ckpt_copy(a: Path, t: Path, change) -> Path:
    ck = t / "hf"
    shutil.copytree(a / "ckpt", ck)
    change(ck)
    return ck


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size - 100])


def _with_ckpt(argv: list[str], ck: Path) -> list[str]:
    argv[argv.index("--hf-checkpoint") + 1] = str(ck)
    return argv


def _other_model(a, t, b):
    other = write_tiny_checkpoint(t / "other", vocab_size=128, hidden=48, layers=2, heads=2, kv_heads=1)
    return _with_ckpt(train_argv(a, t / "out", "--load", str(b[1]), "--num-rollout", "6"), other)


EVAL = ["--eval-prompt-data", "t"]   # + the test set's path, filled in by _eval

BAD = {
    "truncated model.safetensors": (
        lambda a, t, b: _with_ckpt(train_argv(a, t / "out"),
                                   _ckpt_copy(a, t, lambda c: _truncate(c / "model.safetensors"))),
        ["model.safetensors", "truncated"]),
    "garbage model.safetensors": (
        lambda a, t, b: _with_ckpt(train_argv(a, t / "out"),
                                   _ckpt_copy(a, t, lambda c: (c / "model.safetensors").write_bytes(b"\x00" * 4096))),
        ["model.safetensors", "not a readable safetensors file"]),
    "tokenizer files deleted": (
        lambda a, t, b: _with_ckpt(train_argv(a, t / "out"), _ckpt_copy(
            a, t, lambda c: [(c / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")])),
        ["--hf-checkpoint", "no tokenizer in", "hf"]),
    "garbage tokenizer.json": (
        lambda a, t, b: _with_ckpt(train_argv(a, t / "out"),
                                   _ckpt_copy(a, t, lambda c: (c / "tokenizer.json").write_text("{oops"))),
        ["--hf-checkpoint", "tokenizer", "hf"]),
    "--output-dir cannot be created": (lambda a, t, b: train_argv(a, Path("/proc/furlong-test-out")),
                                       ["--output-dir", "/proc"]),
    "--save cannot be created": (lambda a, t, b: train_argv(a, t / "out", "--save", "/proc/furlong-test-save"),
                                 ["--save", "/proc"]),
    "--load of another model": (_other_model, ["--load", "another model", "embed_tokens.weight"]),
    "--num-rollout below the loaded iteration": (
        lambda a, t, b: train_argv(a, t / "out", "--load", str(b[1]), num_rollout=2),
        ["--num-rollout", "below", "iter_0000003"]),
    "--ckpt-step not saved": (lambda a, t, b: train_argv(a, t / "out", "--load", str(b[1]), "--ckpt-step", "9"),
                              ["--ckpt-step", "saved iterations: 1, 2, 3"]),
    "--ckpt-step without --load": (lambda a, t, b: train_argv(a, t / "out", "--ckpt-step", "1"),
                                   ["--ckpt-step", "needs --load"]),
    "--global-batch-size not dividing": (lambda a, t, b: train_argv(a, t / "out", "--global-batch-size", "3"),
                                         ["--global-batch-size", "8 samples"]),
    "--rollout-temperature 0": (lambda a, t, b: train_argv(a, t / "out", "--rollout-temperature", "0"),
                                ["--rollout-temperature", "> 0"]),
    "--eval-top-k 0": (lambda a, t, b: train_argv(a, t / "out", "--eval-top-k", "0", *EVAL,
                                                  str(a / "data" / "test.parquet")), ["--eval-top-k"]),
    "--eval-interval without eval data": (lambda a, t, b: train_argv(a, t / "out", "--eval-interval", "1"),
                                          ["--eval-interval", "--eval-prompt-data"]),
    "--num-rollout 0": (lambda a, t, b: train_argv(a, t / "out", num_rollout=0), ["--num-rollout"]),
    "stop token id above the vocabulary": (
        lambda a, t, b: train_argv(a, t / "out", "--rollout-stop-token-ids", "5", "128"),
        ["--rollout-stop-token-ids", "128", "vocab_size 128"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_one_line_exit_2_nothing_written(assets, baseline, tmp_path, capsys, case):
    build, needles = BAD[case]
    argv = build(assets, tmp_path, baseline)
    code, _, err = run_cli(argv + ["--save", str(tmp_path / "save")] if "--save" not in argv else argv, capsys)
    assert code == 2
    assert_one_line(err, *needles)
    assert not (tmp_path / "out").exists() and not (tmp_path / "save").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".furlong-probe-")]
