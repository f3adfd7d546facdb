"""The training-side miles flags of issue 23, each through a tiny `furlong train` on the CPU: the reference
model (--ref-load, --ref-ckpt-step, --ref-update-interval), --reset-optimizer-states, the LR warm-up and
decay flags, --num-epoch, --start-rollout-id, --custom-config-path and the user loss / TIS / pg-reducer /
reward post-process functions (tests/loss_functions_for_tests.py re-implements furlong's defaults, so a
run with one must train exactly like a run without)."""
from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_helpers import one_line, run_cli, tiny_assets  # noqa: E402
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

from furlong.cli import main  # noqa: E402

FNS = "tests.loss_functions_for_tests."


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("train_flags_assets"))


def argv(a: Path, out: Path, *extra: str, num_rollout: str | None = "2") -> list[str]:
    rollouts = [] if num_rollout is None else ["--num-rollout", num_rollout]
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", "tests.rewards_for_tests.length_reward", *rollouts,
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
            "--lr", "1e-2", "--device", "cpu", "--output-dir", str(out), *extra]


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(x)["kind"] == "rollout"]


def weights(a: Path, save: Path) -> dict[str, torch.Tensor]:
    from furlong.checkpoint.store import load_model_weights
    from furlong.models.hf_io import load_pretrained
    model = load_pretrained(a / "ckpt", dtype=torch.float32)
    load_model_weights(save, model)
    return {k: v.clone() for k, v in model.state_dict().items()}


def train(a: Path, d: Path, name: str, *extra: str, num_rollout: str | None = "2") -> Path:
    code = main(argv(a, d / name, "--save", str(d / f"{name}_ck"), *extra, num_rollout=num_rollout))
    assert code == 0
    return d / name


def assert_same_training(a: Path, d: Path, left: str, right: str) -> None:
    wl, wr = weights(a, d / f"{left}_ck"), weights(a, d / f"{right}_ck")
    assert any(not torch.equal(wl[k], weights_start(a)[k]) for k in wl)   # it trained
    for k in wl:
        torch.testing.assert_close(wl[k], wr[k], rtol=1e-5, atol=1e-6, msg=k)


def weights_start(a: Path) -> dict[str, torch.Tensor]:
    from furlong.models.hf_io import load_pretrained
    return load_pretrained(a / "ckpt", dtype=torch.float32).state_dict()


# ------------------------------------------------------------------ the learning-rate schedule

def test_lr_warmup_fraction_and_init(assets, tmp_path):
    """4 rollouts of one optimizer step: warm-up 0.5 * 4 = 2 steps from 1e-3 to --lr 1e-2, then linear decay."""
    out = train(assets, tmp_path, "run", "--lr-warmup-fraction", "0.5", "--lr-warmup-init", "1e-3",
                "--lr-decay-style", "linear", num_rollout="4")
    assert [m["train/lr"] for m in metrics(out)] == pytest.approx([1e-3, 5.5e-3, 1e-2, 5e-3])


def test_lr_wsd_decay(assets, tmp_path, capsys):
    out = train(assets, tmp_path, "run", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2",
                "--lr-wsd-decay-style", "linear", "--min-lr", "1e-3", num_rollout="4")
    assert [m["train/lr"] for m in metrics(out)] == pytest.approx([1e-2, 1e-2, 1e-2, 5.5e-3])
    code, _, err = run_cli(argv(assets, tmp_path / "bad", "--lr-decay-style", "WSD"), capsys)
    assert code == 2
    one_line(err, "--lr-wsd-decay-iters")


# ------------------------------------------------------------------ run length and start

def test_num_epoch_sets_the_rollouts(assets, tmp_path, capsys):
    """8 prompts, --num-epoch 2, --rollout-batch-size 4: 2 * 8 // 4 = 4 rollouts; with --num-rollout too,
    --num-epoch is ignored with a note (miles)."""
    out = train(assets, tmp_path, "epochs", "--num-epoch", "2", "--rollout-batch-size", "4", num_rollout=None)
    assert [m["step"] for m in metrics(out)] == [0, 1, 2, 3]
    capsys.readouterr()
    assert main(argv(assets, tmp_path / "both", "--num-epoch", "2", num_rollout="1")) == 0
    assert "--num-epoch is ignored" in capsys.readouterr().err
    assert [m["step"] for m in metrics(tmp_path / "both")] == [0]
    code, _, err = run_cli(argv(assets, tmp_path / "none", "--num-epoch", "1", "--rollout-batch-size", "9",
                                num_rollout=None), capsys)
    assert code == 2
    one_line(err, "--num-epoch", "no rollout")


def test_start_rollout_id(assets, tmp_path, capsys):
    out = train(assets, tmp_path, "run", "--start-rollout-id", "2", "--save-interval", "1", num_rollout="4")
    assert [m["step"] for m in metrics(out)] == [2, 3]
    assert sorted(p.name for p in (tmp_path / "run_ck").glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    # with --load it wins over the checkpoint's next rollout (miles): iteration 3 loaded, rollout 3 rerun
    code = main(argv(assets, tmp_path / "run", "--load", str(tmp_path / "run_ck"), "--ckpt-step", "3",
                     "--start-rollout-id", "2", num_rollout="4"))
    assert code == 0
    assert [m["step"] for m in metrics(out)] == [2, 3]
    code, _, err = run_cli(argv(assets, tmp_path / "late", "--start-rollout-id", "2"), capsys)
    assert code == 2
    one_line(err, "--start-rollout-id", "no rollout")


# ------------------------------------------------------------------ --custom-config-path

def test_custom_config_path(assets, tmp_path, capsys):
    """The file sets flags by dest name; the command line wins; a base64: payload works the same way."""
    yaml_text = "lr: 5.0e-3\nlr_decay_style: linear\nnum_rollout: 4\nuse_kl_loss: true\nkl_loss_coef: 0.1\n"
    (tmp_path / "flags.yaml").write_text(yaml_text)
    out = train(assets, tmp_path, "run", "--custom-config-path", str(tmp_path / "flags.yaml"), num_rollout="2")
    saved = json.loads((out / "config.json").read_text())
    assert saved["optim"]["lr"] == 1e-2 and saved["optim"]["lr_decay_style"] == "linear"   # --lr given: it wins
    assert saved["algo"]["use_kl_loss"] is True and saved["rollout"]["num_rollout"] == 2
    assert len(metrics(out)) == 2 and metrics(out)[0]["train/lr"] == pytest.approx(1e-2)
    assert metrics(out)[1]["train/kl_loss"] != 0   # the KL loss the file turned on is trained
    inline = "base64:" + base64.b64encode(yaml_text.encode()).decode()
    out2 = train(assets, tmp_path, "inline", "--custom-config-path", inline, num_rollout="2")
    saved2 = json.loads((out2 / "config.json").read_text())
    for group in ("optim", "algo", "rollout"):
        assert saved2[group] == saved[group]
    for text, needles in (("tis_level: token\n", ["flags.yaml", "tis_level", "not a flag of furlong train"]),
                          ("tensor_model_parallel_size: 2\n", ["tensor_model_parallel_size", "Megatron"]),
                          ("lr: fast\n", ["flags.yaml", "lr", "expected float"]),
                          ("use_tis: 1\n", ["use_tis", "expected bool"]),
                          ("- lr\n", ["mapping"])):
        (tmp_path / "flags.yaml").write_text(text)
        code, _, err = run_cli(argv(assets, tmp_path / "bad", "--custom-config-path", str(tmp_path / "flags.yaml")),
                               capsys)
        assert code == 2, text
        one_line(err, "--custom-config-path", *needles)
    assert not (tmp_path / "bad").exists()
