"""miles' wandb and TensorBoard flags reach their calls: a fake `wandb` module (wandb is not a
dependency) records login/init/log through a tiny `furlong train`; --tb-project-name moves the events."""
from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_helpers import one_line, run_cli, tiny_assets  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("tracking_assets"))


def argv(a: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", "tests.rewards_for_tests.index_reward", "--num-rollout", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
            "--device", "cpu", "--output-dir", str(out), *extra]


@pytest.fixture
def fake_wandb(monkeypatch):
    calls: dict[str, list] = {"login": [], "init": [], "log": [], "finish": []}
    mod = types.ModuleType("wandb")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    mod.login = lambda **kw: calls["login"].append(kw)

    class Run:
        def log(self, metrics, step):
            calls["log"].append((step, metrics))

        def finish(self):
            calls["finish"].append(True)

    def init(**kw):
        calls["init"].append(kw)
        return Run()
    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def test_wandb_flags_reach_login_and_init(assets, tmp_path, fake_wandb, capsys):
    code, _, err = run_cli(argv(assets, tmp_path / "run", "--use-wandb", "--wandb-project", "p", "--wandb-group",
                                "g", "--wandb-team", "team", "--wandb-mode", "online", "--wandb-dir",
                                str(tmp_path / "wb"), "--wandb-run-id", "abc123", "--wandb-host",
                                "https://wandb.example", "--wandb-key", "k", "--disable-wandb-random-suffix"), capsys)
    assert code == 0, err
    (init,) = fake_wandb["init"]
    assert init["entity"] == "team" and init["mode"] == "online" and init["dir"] == str(tmp_path / "wb")
    assert init["id"] == "abc123" and init["resume"] == "allow" and init["name"] == "run"
    assert init["project"] == "p" and init["group"] == "g" and init["config"]["tracking"]["wandb_team"] == "team"
    assert (tmp_path / "wb").is_dir()
    assert fake_wandb["login"] == [{"key": "k", "host": "https://wandb.example"}]
    assert fake_wandb["log"] and fake_wandb["finish"]


def test_offline_mode_skips_the_login_and_bad_mode_is_one_line(assets, tmp_path, fake_wandb, capsys):
    code, _, err = run_cli(argv(assets, tmp_path / "o", "--use-wandb", "--wandb-mode", "offline", "--wandb-host",
                                "https://h"), capsys)
    assert code == 0, err
    assert fake_wandb["login"] == [] and fake_wandb["init"][0]["mode"] == "offline"
    code, _, err = run_cli(argv(assets, tmp_path / "b", "--use-wandb", "--wandb-mode", "sometimes"), capsys)
    assert code == 2
    one_line(err, "--wandb-mode", "online, offline or disabled")


def test_wandb_flags_without_use_wandb_are_noted(assets, tmp_path, capsys):
    code, _, err = run_cli(argv(assets, tmp_path / "n", "--wandb-team", "t", "--tb-project-name", "x"), capsys)
    assert code == 0
    assert "furlong: note: --wandb-team: no effect without --use-wandb" in err
    assert "furlong: note: --tb-project-name: no effect without --use-tensorboard" in err


def test_tb_project_name_moves_the_events(assets, tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    code, _, err = run_cli(argv(assets, tmp_path / "tb", "--use-tensorboard", "--tb-project-name", "proj"), capsys)
    assert code == 0, err
    assert any((tmp_path / "tensorboard_log" / "proj" / "tb").glob("events.out.tfevents.*"))
    assert not (tmp_path / "tb" / "tensorboard").exists()
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "env_tb"))
    code, _, err = run_cli(argv(assets, tmp_path / "tb2", "--use-tensorboard", "--tb-project-name", "proj"), capsys)
    assert code == 0, err
    assert any((tmp_path / "env_tb").glob("events.out.tfevents.*"))
