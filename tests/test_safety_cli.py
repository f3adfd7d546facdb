"""The commands' surfaces (issue 25, "Flags that do nothing"): each of train/sft/eval accepts only the
flags it reads, no prefix abbreviations (a "did you mean" instead), required flags marked, help on every
flag of the small commands, `furlong --version`, and `eval --load` taking --hf-checkpoint from the
checkpoint as `export` does."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

from furlong.cli import _build_parser, main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run_cli(argv, capsys):
    capsys.readouterr()
    code = main(argv)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def help_of(command: str, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["train", "--rollout-batch", "4"], "unrecognized arguments: --rollout-batch 4 (did you mean --rollout-batch-size?)"),
    (["train", "--hf-checkpont", "x"], "did you mean --hf-checkpoint?"),
    (["eval", "--lr", "1e-3"], "--lr is a flag of furlong train, not of furlong eval"),
    (["eval", "--num-rollout", "3"], "--num-rollout is a flag of furlong train, not of furlong eval"),
    (["eval", "--save", "ck"], "--save is a flag of furlong train"),
    (["train", "--sft-max-len", "2"], "--sft-max-len is a flag of furlong sft, not of furlong train"),
    (["sft", "--rollout-batch-size", "2"], "--rollout-batch-size is a flag of furlong train"),
    (["export", "--lod", "x", "--output", "y"], "did you mean --load?"),
])
def test_flags_outside_a_command_or_abbreviated_are_refused(argv, needle, capsys):
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_each_command_shows_only_its_flags_and_marks_required(capsys):
    train, sft, ev = help_of("train", capsys), help_of("sft", capsys), help_of("eval", capsys)
    assert "--sft-max-len" not in train and "--sft-max-len" in sft and "--num-epoch" in train and "--num-epoch" in sft
    assert "[--rollout-batch-size" not in sft and "--rm-type" not in sft and "--eval-prompt-data" not in sft
    assert "--lr " not in ev and "--num-rollout" not in ev and "--save " not in ev and "--load" in ev
    assert "--hf-checkpoint PATH  (required)" in train and "--prompt-data PATH    (required)" in sft
    assert "(required) eval sets" in ev


def test_every_flag_of_the_small_commands_has_help():
    def walk(parser: argparse.ArgumentParser, name: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    if sub_name not in ("train", "sft", "eval"):
                        yield from walk(sub, f"{name} {sub_name}")
            elif action.option_strings and action.dest != "help":
                yield f"{name} {action.option_strings[0]}", action.help
    missing = [flag for flag, h in walk(_build_parser(), "furlong") if not h]
    assert missing == []


def test_version(capsys):
    import furlong
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and out.strip() == f"furlong {furlong.__version__}"


def test_eval_load_takes_the_checkpoint_recorded_in_it(tmp_path, capsys):
    from furlong.tasks.synthetic import prepare_synthetic
    write_tiny_checkpoint(tmp_path / "ckpt", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1)
    prepare_synthetic(tmp_path / "data", 8, 2, 0)
    common = ["--input-key", "messages", "--label-key", "label", "--apply-chat-template",
              "--custom-rm-path", "tests.rewards_for_tests.index_reward", "--rollout-max-response-len", "4",
              "--device", "cpu"]
    assert main(["train", "--hf-checkpoint", str(tmp_path / "ckpt"), "--prompt-data",
                 str(tmp_path / "data" / "train.parquet"), "--num-rollout", "1", "--rollout-batch-size", "2",
                 "--n-samples-per-prompt", "2", "--output-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ck"),
                 *common]) == 0
    code, out, err = run_cli(["eval", "--load", str(tmp_path / "ck"), "--eval-prompt-data", "syn",
                              str(tmp_path / "data" / "test.parquet"), "--output-dir", str(tmp_path / "ev"), *common],
                             capsys)
    assert code == 0, err
    assert "eval/syn" in out
    code, _, err = run_cli(["eval", "--eval-prompt-data", "syn", str(tmp_path / "data" / "test.parquet"),
                            "--output-dir", str(tmp_path / "ev2"), *common], capsys)
    assert code == 2 and "--hf-checkpoint: required (or --load" in err
