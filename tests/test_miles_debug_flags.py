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


@pytest.mark.parametrize("form", ["run_dir", "template"])
def test_rollout_only_then_replay_trains_as_the_live_run(assets, tmp_path, form):
    # miles' form: a path template (a .pt suffix as in miles' recipes; the content is furlong's JSONL);
    # furlong's older form: the bare flag, replayed from the run directory
    template = str(tmp_path / "dumps" / "rollout_{rollout_id}.pt")
    save = ["--save-debug-rollout-data", template] if form == "template" else ["--save-debug-rollout-data"]
    source = template if form == "template" else str(tmp_path / "gen")
    assert main(argv(assets, tmp_path / "live", 1, "--save", str(tmp_path / "live_ck"))) == 0
    assert main(argv(assets, tmp_path / "gen", 1, "--debug-rollout-only", *save,
                     "--save", str(tmp_path / "gen_ck"))) == 0
    assert not (tmp_path / "gen_ck").exists() or not any((tmp_path / "gen_ck").glob("iter_*"))   # nothing trained
    assert not train_metrics(tmp_path / "gen")[0]
    if form == "template":
        assert sorted(p.name for p in (tmp_path / "dumps").iterdir()) == ["rollout_0.pt"]
        assert not (tmp_path / "gen" / "samples").exists() or not any((tmp_path / "gen" / "samples").glob("rollout_*"))
        assert len((tmp_path / "dumps" / "rollout_0.pt").read_text().splitlines()) == 4   # JSONL, one per sample
    assert main(argv(assets, tmp_path / "replay", 1, "--load-debug-rollout-data", source,
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
    (["--save-debug-rollout-data", "a/{step}_{rollout_id}.pt"], ["--save-debug-rollout-data", "not a path template"]),
    (["--save-debug-rollout-data", "a/rollout.pt"], ["--save-debug-rollout-data", "has no {rollout_id}"]),
])
def test_bad_debug_flags_are_one_line(assets, tmp_path, capsys, extra, needles):
    code, _, err = run_cli(argv(assets, tmp_path / "r", 1, *extra), capsys)
    assert code == 2
    one_line(err, *needles)


def test_save_template_writes_every_rollout_and_eval(assets, tmp_path):
    # miles' names: rollout ids 0.., eval files eval_<id> (the eval before training is eval_0, as in miles)
    dump = tmp_path / "d"
    assert main(argv(assets, tmp_path / "r", 2, "--save-debug-rollout-data", str(dump / "{rollout_id}.jsonl"),
                     "--eval-prompt-data", "t", str(assets / "data" / "test.parquet"), "--eval-interval", "2",
                     "--n-samples-per-eval-prompt", "1")) == 0
    assert sorted(p.name for p in dump.iterdir()) == ["0.jsonl", "1.jsonl", "eval_0.jsonl", "eval_1.jsonl"]
    saved = [json.loads(x) for x in (dump / "1.jsonl").read_text().splitlines()]
    assert len(saved) == 4 and all(len(r["response_ids"]) == len(r["rollout_log_probs"]) for r in saved)
    assert rows(tmp_path / "r")[1]["rollout/raw_reward"] == pytest.approx(sum(r["reward"] for r in saved) / 4)
    assert not (tmp_path / "r" / "samples").exists() or not any((tmp_path / "r" / "samples").glob("rollout_*"))


def test_flag_file_true_is_the_bare_flag(tmp_path):
    from furlong.cli import parse_config
    from furlong.config_field import RUN_DIR_SAMPLES
    base = ["--hf-checkpoint", "x", "--prompt-data", "y", "--custom-config-path"]
    for value, want in (("true", RUN_DIR_SAMPLES), ("false", None), ("'o/{rollout_id}.pt'", "o/{rollout_id}.pt")):
        (tmp_path / "f.yaml").write_text(f"save_debug_rollout_data: {value}\n")
        assert parse_config([*base, str(tmp_path / "f.yaml")], reward_given=True).log.save_debug_rollout_data == want


def test_a_miles_pt_dump_is_refused_in_one_line(assets, tmp_path, capsys):
    torch.save({"rollout_id": 0, "samples": []}, tmp_path / "0.pt")
    code, _, err = run_cli(argv(assets, tmp_path / "r", 1, "--load-debug-rollout-data",
                                str(tmp_path / "{rollout_id}.pt")), capsys)
    assert code == 2
    one_line(err, "--load-debug-rollout-data", "0.pt is a pickle", "furlong replays only its own JSONL")


@pytest.fixture
def no_trainer(monkeypatch):
    """Building any trainer part fails the run: the actor, the critic, the reference model."""
    def refuse(*args, **kwargs):
        raise AssertionError("a trainer part was built under --debug-rollout-only")
    import furlong.run.reference
    import furlong.trainer.actor
    import furlong.trainer.critic
    monkeypatch.setattr(furlong.trainer.actor, "Actor", refuse)
    monkeypatch.setattr(furlong.trainer.critic, "build_critic", refuse)
    monkeypatch.setattr(furlong.run.reference, "load_reference", refuse)


def test_rollout_only_builds_no_trainer(assets, tmp_path, no_trainer):
    # ppo with a KL loss: a live run would build the actor, a critic and a reference model
    dump = tmp_path / "d"
    assert main(argv(assets, tmp_path / "r", 2, "--debug-rollout-only", "--advantage-estimator", "ppo",
                     "--use-kl-loss", "--save", str(tmp_path / "ck"),
                     "--save-debug-rollout-data", str(dump / "{rollout_id}.jsonl"))) == 0
    assert sorted(p.name for p in dump.iterdir()) == ["0.jsonl", "1.jsonl"]
    assert [len((dump / f"{k}.jsonl").read_text().splitlines()) for k in (0, 1)] == [4, 4]
    assert len(rows(tmp_path / "r")) == 2 and not any(train_metrics(tmp_path / "r"))
    assert not (tmp_path / "ck").exists() and not (tmp_path / "ck_critic").exists()   # nothing saved, or prepared


def test_rollout_only_from_load_makes_the_resumed_runs_next_rollout(assets, tmp_path, monkeypatch):
    assert main(argv(assets, tmp_path / "first", 1, "--save", str(tmp_path / "ck"))) == 0
    live = tmp_path / "live"
    assert main(argv(assets, tmp_path / "resumed", 2, "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "ck2"),
                     "--save-debug-rollout-data", str(live / "{rollout_id}.jsonl"))) == 0
    import furlong.trainer.actor
    monkeypatch.setattr(furlong.trainer.actor, "Actor", None)   # any use of it fails the run
    rec = tmp_path / "rec"
    assert main(argv(assets, tmp_path / "ro", 2, "--load", str(tmp_path / "ck"), "--debug-rollout-only",
                     "--save-debug-rollout-data", str(rec / "{rollout_id}.jsonl"))) == 0
    assert sorted(p.name for p in rec.iterdir()) == ["1.jsonl"]   # rollout 1 was done by the checkpoint
    # the trained weights and the saved prompt position: the same samples, log-probs included, as the resumed run
    # (the first run's training moved the weights: test_rollout_only_then_replay_trains_as_the_live_run)
    assert (rec / "1.jsonl").read_text() == (live / "1.jsonl").read_text()
