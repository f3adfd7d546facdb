"""`furlong` command-line behaviour: flag errors, bad inputs, --ci-test, the dynamic
filter's bound, `train --help`, and the sft / eval subcommands (prepare and score:
test_cli_prepare_score.py).

Most runs call `furlong.cli.main([...])` in-process (no interpreter + torch start-up
per case); a few go through `python -m furlong` to check the real exit code and
that stderr holds exactly one line and no traceback. Training runs are one
process on the CPU with a tiny random checkpoint and 8-token responses.
"""
from __future__ import annotations

import json
import os
import shutil
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
REWARD = "tests.rewards_for_tests.index_reward"   # varies within every group; see that module


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from furlong.tasks.synthetic import prepare_synthetic
    d = tmp_path_factory.mktemp("cli_assets")
    write_tiny_checkpoint(d / "ckpt", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1)
    prepare_synthetic(d / "data", 8, 2, 0)
    return d


def train_flags(a: Path, out: Path, *extra: str, ckpt: Path | None = None,
                data: str | None = None) -> list[str]:
    return ["train", "--hf-checkpoint", str(ckpt or a / "ckpt"),
            "--prompt-data", data or str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", REWARD, "--num-rollout", "1", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8", "--device", "cpu",
            "--output-dir", str(out), *extra]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()   # drop what set-up printed (e.g. transformers' save progress bar)
    code = main(argv)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def run_proc(argv: list[str], timeout: float = 90) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "furlong", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{err}"
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _chat_row(q: str, label: str = "2") -> str:
    return json.dumps({"messages": [{"role": "user", "content": q}], "label": label})


# ---------------------------------------------------------------- flag errors

@pytest.mark.parametrize("extra,needle", [
    (["--no-such-flag"], "--no-such-flag"),
    (["--dynamic-sampling-filter-path", "a.b.c"], "--dynamic-sampling-filter-path"),
    (["--custom-rm-path", "nope.fn"], "--custom-rm-path"),
    (["--num-rollout", "many"], "--num-rollout"),
])
def test_unknown_flag_or_path_exits_2_naming_it(assets, tmp_path, capsys, extra, needle):
    out = tmp_path / "out"
    code, _, err = run_cli(train_flags(assets, out, *extra), capsys)
    assert code == 2
    assert_one_line(err, needle)
    assert not out.exists()


def test_unknown_rm_type_exits_2(assets, tmp_path, capsys):
    argv = [a for a in train_flags(assets, tmp_path / "out") if a != REWARD and a != "--custom-rm-path"]
    code, _, err = run_cli(argv + ["--rm-type", "nope"], capsys)
    assert code == 2
    assert_one_line(err, "--rm-type", "nope")
    assert not (tmp_path / "out").exists()


def test_unknown_flag_real_process(assets, tmp_path):
    p = run_proc(train_flags(assets, tmp_path / "out", "--bogus-flag", "3"), timeout=60)
    assert p.returncode == 2
    assert_one_line(p.stderr, "--bogus-flag")


# ---------------------------------------------------------------- bad inputs

def _copy_ckpt_without(a: Path, t: Path, pattern: str) -> Path:
    dst = t / "ck"
    shutil.copytree(a / "ckpt", dst)
    for f in dst.glob(pattern):
        f.unlink()
    return dst


def _missing_key(a, t):
    p = write_jsonl(t / "k.jsonl", [_chat_row("1+1?"), json.dumps({"messages": [{"role": "user", "content": "x"}]})])
    return train_flags(a, t / "out", data=str(p))


def _malformed(a, t):
    p = write_jsonl(t / "bad.jsonl", [_chat_row("1+1?"), _chat_row("2+0?"), '{"messages": [oops'])
    return train_flags(a, t / "out", data=str(p))


def _too_long(a, t):
    ck = write_tiny_checkpoint(t / "short_ck", vocab_size=128, hidden=32, layers=1, heads=2, kv_heads=1,
                               max_position_embeddings=64)
    p = write_jsonl(t / "long.jsonl", [_chat_row("1+1?"), _chat_row("what is " + "1+" * 40 + "1?")])
    return train_flags(a, t / "out", ckpt=ck, data=str(p))


BAD_INPUTS = {
    "missing checkpoint dir": (lambda a, t: train_flags(a, t / "out", ckpt=t / "nope"), ["--hf-checkpoint", "nope"]),
    "no config.json": (lambda a, t: train_flags(a, t / "out", ckpt=_copy_ckpt_without(a, t, "config.json")),
                       ["--hf-checkpoint", "config.json"]),
    "no safetensors": (lambda a, t: train_flags(a, t / "out", ckpt=_copy_ckpt_without(a, t, "*.safetensors")),
                       ["--hf-checkpoint", "safetensors"]),
    "data file missing": (lambda a, t: train_flags(a, t / "out", data=str(t / "missing.parquet")),
                          ["missing.parquet"]),
    "missing key": (_missing_key, ["k.jsonl", "row 2", "'label'"]),
    "malformed jsonl": (_malformed, ["bad.jsonl", "row 3", "malformed"]),
    "empty slice": (lambda a, t: train_flags(a, t / "out", data=str(a / "data" / "train.parquet") + "@[5:5]"),
                    ["train.parquet", "empty"]),
    "prompt over context": (_too_long, ["long.jsonl", "row 2", "tokens"]),
    "kl coef and kl loss": (lambda a, t: train_flags(a, t / "out", "--kl-coef", "0.1", "--kl-loss-coef", "0.1"),
                            ["--kl-coef"]),
    "dynamic batch without budget": (lambda a, t: train_flags(a, t / "out", "--use-dynamic-batch-size"),
                                     ["--use-dynamic-batch-size", "--max-tokens-per-gpu"]),
    "save under a file": (lambda a, t: train_flags(a, t / "out", "--save", str(_a_file(t) / "ck")),
                          ["--save", "not a directory"]),
    "output dir is a file": (lambda a, t: train_flags(a, _a_file(t), "--save", str(t / "ck2")),
                             ["--output-dir", "not a directory"]),
    "estimator unknown": (lambda a, t: train_flags(a, t / "out", "--advantage-estimator", "ppo2"),
                          ["--advantage-estimator", "ppo2"]),
    "ppo critic checkpoint missing": (lambda a, t: train_flags(a, t / "out", "--advantage-estimator", "ppo",
                                                               "--critic-hf-checkpoint", str(t / "nope")),
                                      ["--critic-hf-checkpoint", "nope"]),
}


def _a_file(t: Path) -> Path:
    f = t / "a_file"
    f.write_text("x")
    return f


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_one_line_exit_2_nothing_written(assets, tmp_path, capsys, case):
    build, needles = BAD_INPUTS[case]
    argv = build(assets, tmp_path)
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert_one_line(err, *needles)
    assert not (tmp_path / "out").exists()


def test_bad_input_real_process(assets, tmp_path):
    p = run_proc(_malformed(assets, tmp_path), timeout=60)
    assert p.returncode == 2
    assert_one_line(p.stderr, "bad.jsonl", "row 3")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- --ci-test and the filter bound

def _ci_flags(a, out, threshold):
    return train_flags(a, out, "--eval-prompt-data", "t", str(a / "data" / "test.parquet"),
                       "--ci-test", "--ci-metric-checker-key", "eval/t", "--ci-metric-checker-threshold", threshold)


def test_ci_threshold_not_reached_fails_naming_metric(assets, tmp_path, capsys):
    # index_reward scores every eval sample 1.0, so no eval can reach 1.5
    code, out, err = run_cli(_ci_flags(assets, tmp_path / "out", "1.5"), capsys)
    assert code != 0
    assert_one_line(err, "eval/t", "1.5")
    assert "[rollout 1/1]" in out   # the run itself completed; only the check failed


def test_ci_threshold_zero_passes(assets, tmp_path, capsys):
    # the step-0 ppo_kl check is on here (no --ci-disable-kl-checker), so it passes too
    code, out, err = run_cli(_ci_flags(assets, tmp_path / "out", "0"), capsys)
    assert code == 0, err
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["eval", "rollout"]
    assert rows[0]["eval/t"] == 1.0


def test_dynamic_filter_all_zero_reward_stops(assets, tmp_path):
    argv = train_flags(assets, tmp_path / "out", "--dynamic-sampling-filter-path",
                       "furlong.rollout.filters.check_reward_nonzero_std")
    argv[argv.index(REWARD)] = "tests.rewards_for_tests.zero_reward"
    p = run_proc(argv, timeout=90)   # an endless loop would hit the timeout
    assert p.returncode not in (0, 2)
    assert_one_line(p.stderr, "kept 0/2")


# ---------------------------------------------------------------- other subcommands

def test_sft_saves_loadable_hf_checkpoint(assets, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    save = tmp_path / "hf"
    code, out, err = run_cli(["sft", "--hf-checkpoint", str(assets / "ckpt"),
                              "--prompt-data", str(assets / "data" / "sft.parquet"), "--global-batch-size", "4",
                              "--lr", "1e-3", "--device", "cpu", "--output-dir", str(tmp_path / "out"),
                              "--save", str(save)], capsys)
    assert code == 0, err
    assert "[sft 2/2" in out   # 8 rows / batch 4 = 2 steps
    losses = [json.loads(x)["sft/loss"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(v > 0 for v in losses)
    model = AutoModelForCausalLM.from_pretrained(save, dtype=torch.float32)
    logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 128) and torch.isfinite(logits).all()
    before = load_file(str(next((assets / "ckpt").glob("*.safetensors"))))
    after = load_file(str(next(save.glob("*.safetensors"))))
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(before[name], after[name].float())   # training changed the weights


def test_eval_prints_metric(assets, tmp_path, capsys):
    code, out, err = run_cli(["eval", "--hf-checkpoint", str(assets / "ckpt"), "--eval-prompt-data", "syn",
                              str(assets / "data" / "test.parquet"), "--input-key", "messages",
                              "--label-key", "label", "--apply-chat-template", "--custom-rm-path", REWARD,
                              "--rollout-max-response-len", "8", "--device", "cpu",
                              "--output-dir", str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"eval/syn": 1.0}
    assert len(list((tmp_path / "out" / "samples").glob("eval_syn_*.jsonl"))) == 1


def test_train_help_shows_defaults_metavars_and_groups():
    p = run_proc(["train", "--help"])
    assert p.returncode == 0
    out = p.stdout
    assert "--hf-checkpoint PATH" in out and "--rollout-batch-size N" in out and "--lr X" in out
    assert "(default: 1024)" in out and "furlong sft only:" not in out   # train's flags only
    # a list default as it is typed (default_factory fields were shown without one)
    assert "(default: kv_cache weight)" in " ".join(out.split())
    assert "DATA.HF_CHECKPOINT" not in out


@pytest.mark.parametrize("edit,needles", [
    (lambda c: [1, 2], ["config.json", "JSON object", "list"]),
    (lambda c: {**c, "vocab_size": -1}, ["config.json", "'vocab_size'", "positive integer"]),
    (lambda c: {**c, "hidden_size": "32"}, ["config.json", "'hidden_size'", "'32'"]),
    (lambda c: {**c, "rms_norm_eps": "tiny"}, ["config.json", "'rms_norm_eps'"]),
])
def test_bad_config_json_is_one_line_naming_the_key(assets, tmp_path, capsys, edit, needles):
    ck = tmp_path / "ck"
    shutil.copytree(assets / "ckpt", ck)
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(edit(cfg)))
    code, _, err = run_cli(train_flags(assets, tmp_path / "out", ckpt=ck), capsys)
    assert code == 2
    assert_one_line(err, *needles)
    assert not (tmp_path / "out").exists()
