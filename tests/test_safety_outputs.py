"""Nothing overwritten: export/sft/score targets, sft's metrics.jsonl, run ids in the run and checkpoint
directories, stale save temporaries (issue 25, "Data loss"). Each case is the issue's reproduction."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_helpers import one_line, run_cli, tiny_assets  # noqa: E402

from furlong.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("safety_assets"))


def train_argv(a: Path, out: Path, num_rollout: int, *extra: str) -> list[str]:
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", "tests.rewards_for_tests.index_reward", "--num-rollout", str(num_rollout),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
            "--lr", "1e-3", "--device", "cpu", "--output-dir", str(out), *extra]


def sft_argv(a: Path, out: Path, *extra: str) -> list[str]:
    return ["sft", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "sft.parquet"),
            "--global-batch-size", "4", "--lr", "1e-3", "--device", "cpu", "--output-dir", str(out), *extra]


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    """A training run with a checkpoint per rollout (iter_0000001, iter_0000002)."""
    d = tmp_path_factory.mktemp("trained")
    assert main(train_argv(assets, d / "run", 2, "--save", str(d / "ck"), "--save-interval", "1")) == 0
    return d



def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}



# ---------------------------------------------------------------- export

def test_export_into_a_training_iteration_is_refused(trained, capsys):
    it = trained / "ck" / "iter_0000002"
    before = snapshot(it)
    code, _, err = run_cli(["export", "--load", str(trained / "ck"), "--output", str(it), "--overwrite"], capsys)
    assert code == 2
    one_line(err, "--output", "is inside the --load")
    assert snapshot(it) == before


def test_export_onto_its_source_hf_checkpoint_is_refused(assets, trained, capsys):
    before = snapshot(assets / "ckpt")
    for extra in ([], ["--hf-checkpoint", str(assets / "ckpt")]):   # recorded, and given
        code, _, err = run_cli(["export", "--load", str(trained / "ck"), "--output", str(assets / "ckpt"),
                                "--overwrite", *extra], capsys)
        assert code == 2
        one_line(err, "--output", "is the --hf-checkpoint")
    assert snapshot(assets / "ckpt") == before


def test_export_keeps_unrelated_files_and_needs_overwrite(trained, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model-00002-of-00002.safetensors").write_bytes(b"stale shard of older weights")
    code, _, err = run_cli(["export", "--load", str(trained / "ck"), "--output", str(out)], capsys)
    assert code == 2
    one_line(err, "--output", "not empty", "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["model-00002-of-00002.safetensors", "notes.txt"]
    code, _, err = run_cli(["export", "--load", str(trained / "ck"), "--output", str(out), "--overwrite"], capsys)
    assert code == 0, err
    assert (out / "notes.txt").read_text() == "mine"                      # not the command's: kept
    assert not (out / "model-00002-of-00002.safetensors").exists()         # the replaced weights' shard
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_export_through_a_symlink_writes_its_target_and_keeps_the_link(trained, tmp_path, capsys):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    code, _, err = run_cli(["export", "--load", str(trained / "ck"), "--output", str(link)], capsys)
    assert code == 0, err
    assert link.is_symlink() and (real / "model.safetensors").is_file()


# ---------------------------------------------------------------- score

def test_score_never_replaces_a_symlinked_directory_or_an_existing_file(tmp_path, capsys):
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps({"response": "\\boxed{2}", "label": "2"}) + "\n")
    d = tmp_path / "d"
    d.mkdir()
    (d / "keep.txt").write_text("x")
    link = tmp_path / "out.jsonl"
    link.symlink_to(d, target_is_directory=True)
    code, _, err = run_cli(["score", "--input", str(src), "--output", str(link), "--overwrite"], capsys)
    assert code == 2
    one_line(err, "--output", "is a directory")
    assert link.is_symlink() and (d / "keep.txt").read_text() == "x"
    f = tmp_path / "scores.jsonl"
    f.write_text("old\n")
    code, _, err = run_cli(["score", "--input", str(src), "--output", str(f)], capsys)
    assert code == 2
    one_line(err, "--output", "exists", "--overwrite")
    assert f.read_text() == "old\n"
    assert run_cli(["score", "--input", str(src), "--output", str(f), "--overwrite"], capsys)[0] == 0
    assert json.loads(f.read_text())["score"] == 1.0
    code, _, err = run_cli(["score", "--input", str(src), "--output", str(src), "--overwrite"], capsys)
    assert code == 2 and "is the --input" in err


# ---------------------------------------------------------------- sft

def test_sft_refuses_a_used_save_or_run_dir_before_training(assets, tmp_path, capsys):
    save = tmp_path / "hf"
    save.mkdir()
    (save / "notes.txt").write_text("mine")
    code, out, err = run_cli(sft_argv(assets, tmp_path / "run", "--save", str(save)), capsys)
    assert code == 2 and "[sft" not in out        # refused before the first step
    one_line(err, "--save", "not empty")
    code, _, err = run_cli(sft_argv(assets, tmp_path / "run", "--save", str(assets / "ckpt"), "--overwrite"),
                           capsys)
    assert code == 2
    one_line(err, "--save", "is the --hf-checkpoint")


def test_sft_metrics_follow_train_rules_and_stale_temps_go(assets, tmp_path, capsys):
    run, save = tmp_path / "run", tmp_path / "hf"
    dead = tmp_path / ".hf.tmp-999999999-x"      # a killed save's (its process is gone)
    live = tmp_path / f".hf.tmp-{os.getppid()}-y"   # a live process' save in progress
    dead.mkdir()
    live.mkdir()
    assert run_cli(sft_argv(assets, run, "--save", str(save)), capsys)[0] == 0
    assert not dead.exists() and live.exists()
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".hf.tmp-")] == [live.name]
    code, _, err = run_cli(sft_argv(assets, run, "--save", str(save)), capsys)
    assert code == 2
    one_line(err, "--output-dir", "already holds a run")
    assert run_cli(sft_argv(assets, run, "--save", str(save), "--overwrite"), capsys)[0] == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2    # started over, not appended
    shutil.rmtree(live)


# ---------------------------------------------------------------- run ids

def test_resume_into_another_runs_output_dir_is_refused(assets, trained, tmp_path, capsys):
    other = tmp_path / "other"
    assert main(train_argv(assets, other, 1)) == 0
    before = (other / "metrics.jsonl").read_text()
    run_id = (trained / "ck" / "run_id.txt").read_text().strip()
    assert (trained / "run" / "run_id.txt").read_text().strip() == run_id
    code, _, err = run_cli(train_argv(assets, other, 3, "--load", str(trained / "ck")), capsys)
    assert code == 2
    one_line(err, "--output-dir", "holds run", run_id)
    assert (other / "metrics.jsonl").read_text() == before


def test_overwrite_into_a_used_save_removes_the_old_runs_iterations(assets, tmp_path, capsys):
    ck = tmp_path / "ck"
    assert main(train_argv(assets, tmp_path / "a", 2, "--save", str(ck), "--save-interval", "1")) == 0
    (ck / "notes.txt").write_text("mine")
    old_id = (ck / "run_id.txt").read_text()
    code, _, err = run_cli(train_argv(assets, tmp_path / "b", 1, "--save", str(ck)), capsys)
    assert code == 2
    one_line(err, "--save", "already holds checkpoints", old_id.strip())
    assert main(train_argv(assets, tmp_path / "b", 1, "--save", str(ck), "--overwrite")) == 0
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt",
                                                     "notes.txt", "run_id.txt"]
    assert (ck / "run_id.txt").read_text() != old_id
    assert (tmp_path / "b" / "run_id.txt").read_text() == (ck / "run_id.txt").read_text()
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    import furlong
    assert cfg["furlong_version"] == furlong.__version__ and cfg["run_id"] == (ck / "run_id.txt").read_text().strip()
    assert "command_line" in cfg and cfg["rollout"]["num_rollout"] == 1


def test_overwrite_removes_old_sample_dumps(assets, tmp_path):
    out = tmp_path / "run"
    assert main(train_argv(assets, out, 2, "--save-debug-rollout-data")) == 0
    assert (out / "samples" / "rollout_train_2.jsonl").is_file()
    (out / "samples" / "mine.txt").write_text("x")
    assert main(train_argv(assets, out, 1, "--save-debug-rollout-data", "--overwrite")) == 0
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["mine.txt", "rollout_train_1.jsonl"]
