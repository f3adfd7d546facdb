"""`furlong train` with --custom-generate-function-path and --rollout-function-path on the CPU: multi-turn
samples with tool tokens masked out, and each bad-function case as one line naming the function and sample."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

from furlong.cli import main  # noqa: E402

GEN = "tests.generate_for_tests."


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from furlong.tasks.synthetic import prepare_synthetic
    d = tmp_path_factory.mktemp("custom_gen")
    write_tiny_checkpoint(d / "ckpt", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1,
                          max_position_embeddings=512)
    prepare_synthetic(d / "data", 8, 2, 0)
    return d


def argv(a: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", "tests.rewards_for_tests.index_reward", "--num-rollout", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "16",
            "--device", "cpu", "--output-dir", str(out), "--custom-generate-timeout", "5", *extra]


def metrics(out: Path) -> dict:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]


def test_two_turn_generate_trains_on_model_tokens_only(assets, tmp_path):
    out = tmp_path / "run"
    assert main(argv(assets, out, "--custom-generate-function-path", GEN + "two_turns",
                     "--save-debug-rollout-data")) == 0
    m = metrics(out)
    assert m["rollout/turns/mean"] == 2.0
    assert m["rollout/trained_tokens/mean"] == 8.0                  # 4 + 4 model tokens; 5 tool tokens not
    assert m["rollout/response_len/mean"] == 13.0
    assert m["train/loss"] == m["train/loss"]                         # a finite number: it trained


@pytest.mark.parametrize("fn,words", [("raises_on_group_0", ["raised on sample (group 0", "tool server unreachable"]),
                                      ("hangs", ["took more than --custom-generate-timeout 0.3s on sample"]),
                                      ("wrong_type", ["returned dict, not a furlong Sample on sample"]),
                                      ("too_long", ["over the context limit of"])])
def test_bad_functions_stop_with_one_line(assets, tmp_path, capsys, fn, words):
    code = main(argv(assets, tmp_path / "run", "--custom-generate-function-path", GEN + fn,
                     "--custom-generate-timeout", "0.3"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert GEN + fn in err[0] and all(w in err[0] for w in words), err[0]


def test_drop_counts_failed_groups(assets, tmp_path):
    out = tmp_path / "run"
    assert main(argv(assets, out, "--custom-generate-function-path", GEN + "raises_on_group_0",
                     "--custom-generate-on-error", "drop")) == 0
    m = metrics(out)
    assert m["rollout/custom_generate/num_failed"] == 2.0 and m["rollout/turns/mean"] == 2.0


def test_bad_flags_are_one_line_exit_2(assets, tmp_path, capsys):
    assert main(argv(assets, tmp_path / "r1", "--custom-generate-function-path", GEN + "not_async")) == 2
    assert "--custom-generate-function-path: tests.generate_for_tests.not_async must be an async function" \
        in capsys.readouterr().err
    assert main(argv(assets, tmp_path / "r2", "--custom-generate-function-path", GEN + "missing")) == 2
    assert "has no function 'missing'" in capsys.readouterr().err
    assert main(argv(assets, tmp_path / "r3", "--custom-generate-on-error", "skip")) == 2
    assert "--custom-generate-on-error: expected stop or drop" in capsys.readouterr().err


def test_rollout_function_replaces_the_rollout(assets, tmp_path):
    out = tmp_path / "run"
    assert main(argv(assets, out, "--rollout-function-path", GEN + "rollout_two_groups_each")) == 0
    m = metrics(out)
    assert m["rollout/raw_reward"] == 0.5 and m["rollout/response_len/mean"] == 2.0
