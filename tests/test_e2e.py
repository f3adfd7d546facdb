"""End-to-end `furlong train` runs: the docs/design.md §1 flag block as given, multi-process
error reporting, the algorithm flag sets, broken rewards, and each estimator learning (resume,
stopping and checkpoint failures: test_e2e_resume.py).

The §1 block runs as written (2 gloo worker processes on the CPU) with only its
paths swapped for tiny test files, --num-rollout 1, and one deviation for CPU
time: --rollout-max-response-len 32 instead of 1024: a random model's responses
run to the maximum length, so 1024 would make every one of the 512 over-sampled
rows decode ~1000 tokens on the CPU.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

from furlong.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # so --custom-rm-path tests.rewards_for_tests.* imports in-process
    sys.path.insert(0, str(ROOT))

# docs/design.md §1, verbatim but for the paths (/models/..., /data/...), --num-rollout 60 -> 1
# and --rollout-max-response-len 1024 -> 32 (module docstring).
SECTION_1_FLAGS = """
--hf-checkpoint {ckpt}
--prompt-data {train} --input-key messages --label-key label
--apply-chat-template --rollout-shuffle --rm-type math
--num-rollout 1 --rollout-batch-size 32 --n-samples-per-prompt 8
--rollout-max-response-len 32 --rollout-temperature 1
--over-sampling-batch-size 64
--dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
--global-batch-size 256
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1
--adam-beta1 0.9 --adam-beta2 0.98
--advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl
--kl-coef 0.00 --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
--rollout-num-gpus-per-engine 2 --sglang-decode-log-interval 1000 --sglang-enable-metrics
--eval-interval 20 --eval-prompt-data gsm8k {test}
--n-samples-per-eval-prompt 1 --eval-max-response-len 1024 --eval-top-k 1
--update-weight-buffer-size 536870912
--use-dynamic-batch-size --max-tokens-per-gpu 32768
--ci-test --ci-disable-kl-checker --ci-metric-checker-key eval/gsm8k
--ci-metric-checker-threshold 0.71
--actor-num-nodes 1 --actor-num-gpus-per-node 2 --colocate --train-backend fsdp
"""

# A random model never solves a math problem, so --rm-type math would give every
# sample 0 and the dynamic filter would drop every group. --custom-rm-path wins
# over --rm-type (as in miles): index_reward is deterministic, differs within every
# group (the filter keeps groups), and scores eval samples 1.0 (so the block's
# --ci-test threshold 0.71 is met).
REWARD = "tests.rewards_for_tests.index_reward"

SECTION_7_NAMES = [
    "rollout/raw_reward", "rollout/response_len/mean", "rollout/response_len/max", "rollout/truncated_ratio",
    "rollout/rollout_log_probs", "train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl",
    "train/entropy", "train/grad_norm", "train/lr", "train/num_micro_batches", "perf/rollout_time",
    "perf/log_probs_time", "perf/actor_train_time", "perf/update_weights_time", "perf/step_time",
    "perf/rollout_tok_per_s", "perf/actor_train_tok_per_s", "perf/actor_train_mfu",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from furlong.tasks.synthetic import prepare_synthetic
    d = tmp_path_factory.mktemp("e2e_assets")
    # context 2048: the block's --eval-max-response-len 1024 plus a prompt must fit
    write_tiny_checkpoint(d / "ckpt", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1,
                          max_position_embeddings=2048)
    prepare_synthetic(d / "data", 16, 2, 0)   # 2 eval prompts: one per rank
    return d


def run_proc(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "furlong", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def section_1_argv(a: Path, out: Path, **replace: str) -> list[str]:
    flags = SECTION_1_FLAGS.format(ckpt=a / "ckpt", train=a / "data" / "train.parquet",
                                   test=a / "data" / "test.parquet")
    argv = ["train", *shlex.split(flags), "--custom-rm-path", REWARD, "--output-dir", str(out)]
    for flag, value in replace.items():
        argv[argv.index(flag) + 1] = value
    return argv


def test_section_1_flag_block(assets, tmp_path):
    out = tmp_path / "run"
    p = run_proc(section_1_argv(assets, out), timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("--sglang-decode-log-interval --sglang-enable-metrics only tune SGLang") == 1
    assert "[rollout 1/1]" in p.stdout and "ETA" in p.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["parallel"]["actor_num_gpus_per_node"] == 2 and cfg["rollout"]["n_samples_per_prompt"] == 8
    rows = read_metrics(out)
    assert [r["kind"] for r in rows] == ["eval", "rollout"]
    assert rows[0]["eval/gsm8k"] == 1.0
    step = rows[1]
    assert step["step"] == 0
    missing = [k for k in SECTION_7_NAMES if k not in step]
    assert not missing, missing
    assert step["rollout/raw_reward"] == 0.5   # 32 kept groups of 8, half of each rewarded
    assert step["train/num_micro_batches"] >= 1 and step["train/lr"] == pytest.approx(1e-6)
    assert len(list((out / "samples").glob("eval_gsm8k_*.jsonl"))) == 1


def test_worker_error_is_one_line_with_two_processes(assets, tmp_path):
    # every rank fails the same way in the rollout; the parent prints one line, no traceback
    argv = section_1_argv(assets, tmp_path / "run", **{"--custom-rm-path": "tests.rewards_for_tests.zero_reward",
                                                       "--rollout-batch-size": "2", "--over-sampling-batch-size": "4",
                                                       "--n-samples-per-prompt": "2", "--global-batch-size": "4",
                                                       "--eval-max-response-len": "8"})
    argv = [a for a in argv if a not in ("--sglang-enable-metrics",)]
    argv[argv.index("--sglang-decode-log-interval"):argv.index("--sglang-decode-log-interval") + 2] = []
    p = run_proc(argv, timeout=90)
    assert p.returncode == 1
    # notes about flags that do not apply (printed before the run starts) are not errors
    lines = [x for x in p.stderr.strip().splitlines() if not x.startswith("furlong: note:")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "kept 0/2" in lines[0]


def test_worker_bad_input_is_one_line_exit_2(assets, tmp_path):
    argv = section_1_argv(assets, tmp_path / "run", **{"--prompt-data": str(tmp_path / "none.parquet")})
    p = run_proc(argv, timeout=60)
    assert p.returncode == 2
    err = [x for x in p.stderr.strip().splitlines() if not x.startswith("furlong: note:")]
    assert len(err) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "none.parquet" in err[0]
    assert not (tmp_path / "run").exists()


def _resume_flags(a: Path, out: Path, num_rollout: int, *extra: str) -> list[str]:
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template", "--rollout-shuffle",
            "--custom-rm-path", "tests.rewards_for_tests.hash_reward", "--num-rollout", str(num_rollout),
            "--rollout-batch-size", "3", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "12",
            "--lr", "1e-3", "--device", "cpu", "--output-dir", str(out), *extra]


ALGORITHMS = {
    "gspo": ["--advantage-estimator", "gspo", "--eps-clip", "3e-4", "--eps-clip-high", "4e-4"],
    "rloo-dr-grpo": ["--advantage-estimator", "rloo", "--loss-agg-mode", "seq-mean-token-sum-norm"],
    "reinforce++": ["--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.01", "--gamma", "0.99"],
    "reinforce++-baseline": ["--advantage-estimator", "reinforce_plus_plus_baseline", "--kl-coef", "0.02"],
    "dapo-style": ["--use-tis", "--tis-clip-low", "0.1", "--normalize-advantages",
                   "--overlong-buffer-len", "4", "--loss-agg-mode", "token-mean", "--use-kl-loss",
                   "--kl-loss-coef", "0.01", "--use-unbiased-kl"],
    "rollout-logprobs": ["--use-rollout-logprobs", "--normalize-advantages"],
}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_algorithm_flags_run_end_to_end(assets, tmp_path, capsys, name):
    """Each estimator and miles/verl algorithm flag set trains two rollouts with finite losses."""
    out = tmp_path / "run"
    argv = section_1_argv(assets, out, **{"--num-rollout": "2", "--rollout-batch-size": "4",
                                          "--over-sampling-batch-size": "4", "--global-batch-size": "32",
                                          "--actor-num-gpus-per-node": "1", "--rollout-max-response-len": "12",
                                          "--eval-max-response-len": "8", "--rollout-num-gpus-per-engine": "1"})
    argv = [a for a in argv if a not in ("--ci-test",)] + ALGORITHMS[name]
    assert main(argv) == 0, capsys.readouterr().err
    steps = [r for r in read_metrics(out) if r["kind"] == "rollout"]
    assert len(steps) == 2
    for r in steps:
        assert all(isinstance(r[k], float) and r[k] == r[k] for k in ("train/loss", "train/pg_loss", "train/grad_norm"))


@pytest.mark.parametrize("fn,needle", [("nan_reward", "is nan: rewards must be finite"),
                                       ("raising_reward", "reward function raising_reward raised on sample "
                                                          "(group 0, index 1): KeyError"),
                                       ("slow_reward", "took more than --reward-timeout 0.5s")])
def test_broken_reward_stops_in_one_line(assets, tmp_path, capsys, fn, needle):
    argv = _resume_flags(assets, tmp_path / "run", 2, "--reward-timeout", "0.5")
    argv[argv.index("--custom-rm-path") + 1] = f"tests.rewards_for_tests.{fn}"
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run" / "metrics.jsonl").read_text().strip()     # no step was logged


@pytest.mark.parametrize("estimator,extra", [
    ("grpo", []), ("gspo", ["--eps-clip", "3e-3", "--eps-clip-high", "4e-3"]), ("rloo", []),
    ("reinforce_plus_plus", ["--kl-coef", "0.001"]), ("reinforce_plus_plus_baseline", ["--kl-coef", "0.001"])])
def test_each_estimator_learns(assets, tmp_path, capsys, estimator, extra):
    """A learning check that can fail: the reward is the share of 'e' in the response (about 2% for the
    random tiny model); eight rollouts at lr 1e-2 must raise the training reward several-fold."""
    out = tmp_path / "run"
    argv = _resume_flags(assets, out, 8, "--advantage-estimator", estimator, "--rollout-batch-size", "8",
                         "--n-samples-per-prompt", "8", *extra)
    argv[argv.index("--custom-rm-path") + 1] = "tests.rewards_for_tests.letter_reward"
    argv[argv.index("--lr") + 1] = "1e-2"
    argv[argv.index("--rollout-max-response-len") + 1] = "8"
    assert main(argv) == 0, capsys.readouterr().err
    rewards = [r["rollout/raw_reward"] for r in read_metrics(out)]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > 0.2 and last > 4 * first, rewards
