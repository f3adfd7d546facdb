"""miles' debugging flags through `furlong train` on CPU: --debug-rollout-only, --load-debug-rollout-data
(replay: the same training as the live run), --debug-train-only, --save-debug-train-data, --dump-details."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_helpers import one_line, run_cli, tiny_assets  # noqa: E402

from furlong.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("debug_assets"))


def argv(a: Path, out: Path, num_rollout: int, *extra: str) -> list[str]:
    # two optimizer steps per rollout: old log-probs from a trainer pass, a policy that moves in between
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", "tests.rewards_for_tests.index_reward", "--num-rollout", str(num_rollout),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "2",
            "--rollout-max-response-len", "6", "--lr", "1e-2", "--device", "cpu", "--seed", "7",
            "--output-dir", str(out), *extra]


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"rollout"' in x]


def train_metrics(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k.startswith("train/")} for r in rows(out)]


def weights(d: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    hf = tmp / f"hf_{d.name}"
    assert main(["export", "--load", str(d), "--output", str(hf)]) == 0
    return {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_rollout_only_then_replay_trains_as_the_live_run(assets, tmp_path):
    assert main(argv(assets, tmp_path / "live", 1, "--save", str(tmp_path / "live_ck"))) == 0
    assert main(argv(assets, tmp_path / "gen", 1, "--debug-rollout-only", "--save-debug-rollout-data",
                     "--save", str(tmp_path / "gen_ck"))) == 0
    assert not (tmp_path / "gen_ck").exists() or not any((tmp_path / "gen_ck").glob("iter_*"))   # nothing trained
    assert not train_metrics(tmp_path / "gen")[0]
    assert main(argv(assets, tmp_path / "replay", 1, "--load-debug-rollout-data", str(tmp_path / "gen"),
                     "--save", str(tmp_path / "replay_ck"))) == 0
    live, replay = train_metrics(tmp_path / "live"), train_metrics(tmp_path / "replay")
    assert live[0]["train/num_steps"] == 2 and live == replay
    assert rows(tmp_path / "live")[0]["rollout/raw_reward"] == rows(tmp_path / "replay")[0]["rollout/raw_reward"]
    a, b = weights(tmp_path / "live_ck", tmp_path), weights(tmp_path / "replay_ck", tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from safetensors.torch import load_file
    start = load_file(str(assets / "ckpt" / "model.safetensors"))
    assert any(not torch.equal(a[k], start[k].to(a[k].dtype)) for k in a if k in start)   # it did train


def test_dump_details_and_replay_of_two_rollouts(assets, tmp_path):
    dump = tmp_path / "dump"
    assert main(argv(assets, tmp_path / "live", 2, "--dump-details", str(dump))) == 0
    assert sorted(p.name for p in (dump / "rollout_data").iterdir()) == ["0.jsonl", "1.jsonl"]
    saved = torch.load(dump / "train_data" / "1_0.pt", weights_only=False)
    assert saved["rollout_id"] == 1 and len(saved["samples"]) == 4
    assert saved["samples"][0]["advantages"].shape == saved["samples"][0]["rollout_log_probs"].shape
    assert main(argv(assets, tmp_path / "replay", 2, "--load-debug-rollout-data", str(dump),
                     "--save-debug-train-data", str(tmp_path / "td" / "{rollout_id}-{rank}.pt"))) == 0
    assert train_metrics(tmp_path / "live") == train_metrics(tmp_path / "replay")
    again = torch.load(tmp_path / "td" / "1-0.pt", weights_only=False)
    assert all(torch.equal(x["advantages"], y["advantages"]) for x, y in zip(saved["samples"], again["samples"]))
    # a template path works too, and a missing rollout is one line naming the flag
    template = str(dump / "rollout_data" / "{rollout_id}.jsonl")
    assert main(argv(assets, tmp_path / "t", 1, "--load-debug-rollout-data", template)) == 0


@pytest.mark.parametrize("extra,needles", [
    (["--debug-train-only"], ["--debug-train-only", "needs --load-debug-rollout-data"]),
    (["--debug-rollout-only", "--load-debug-rollout-data", "x"], ["--debug-rollout-only", "cannot be combined"]),
    (["--load-debug-rollout-data", "nowhere"], ["--load-debug-rollout-data", "no saved rollout 1"]),
    (["--save-debug-train-data", "a/{step}.pt"], ["--save-debug-train-data", "not a path template"]),
])
def test_bad_debug_flags_are_one_line(assets, tmp_path, capsys, extra, needles):
    code, _, err = run_cli(argv(assets, tmp_path / "r", 1, *extra), capsys)
    assert code == 2
    one_line(err, *needles)
