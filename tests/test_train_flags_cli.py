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
            "--custom-rm-path", "tests.rewards_for_tests.index_reward", *rollouts,
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


# ------------------------------------------------------------------ the reference model

KL = ("--use-kl-loss", "--kl-loss-coef", "0.1")


def test_ref_load_hf_folder_and_furlong_checkpoint(assets, tmp_path, capsys):
    """The KL against the reference at the first step is 0 when the reference is the initial weights (by
    default, or --ref-load naming the same HF folder) and not when it is another model's or a trained one."""
    base = train(assets, tmp_path, "base", *KL, num_rollout="1")
    assert metrics(base)[0]["train/kl_loss"] == 0
    same = train(assets, tmp_path, "same", *KL, "--ref-load", str(assets / "ckpt"), num_rollout="1")
    assert metrics(same)[0]["train/kl_loss"] == pytest.approx(0, abs=1e-6)
    other = write_tiny_checkpoint(tmp_path / "other", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1, seed=7)
    capsys.readouterr()
    out = train(assets, tmp_path, "other", *KL, "--ref-load", str(other), num_rollout="1")
    assert "reference model: " + str(other) in capsys.readouterr().out
    assert abs(metrics(out)[0]["train/kl_loss"]) > 1e-3
    # a furlong --save directory: the base run's iteration 1 (trained once: it differs from the start)
    ck = train(assets, tmp_path, "ck", *KL, "--ref-load", str(tmp_path / "base_ck"), "--ref-ckpt-step", "1",
               num_rollout="1")
    kl_trained = metrics(ck)[0]["train/kl_loss"]
    assert abs(kl_trained) > 1e-6 and kl_trained != metrics(out)[0]["train/kl_loss"]

    (tmp_path / "megatron" / "iter_0000001").mkdir(parents=True)
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("1")
    bigger = write_tiny_checkpoint(tmp_path / "bigger", vocab_size=128, hidden=64, layers=2, heads=2, kv_heads=1)
    for ref, needles in ((tmp_path / "megatron", ["Megatron torch_dist", "HF folder"]),
                         (bigger, ["another model"]), (tmp_path / "nowhere", ["not a directory"]),
                         (tmp_path / "base", ["neither an HF folder"])):
        code, _, err = run_cli(argv(assets, tmp_path / "bad", *KL, "--ref-load", str(ref)), capsys)
        assert code == 2, ref
        one_line(err, "--ref-load", *needles)
    code, _, err = run_cli(argv(assets, tmp_path / "bad", *KL, "--ref-load", str(tmp_path / "base_ck"),
                                "--ref-ckpt-step", "5"), capsys)
    assert code == 2
    one_line(err, "--ref-ckpt-step", "no iteration 5")
    code, _, err = run_cli(argv(assets, tmp_path / "bad", "--ref-load", str(other)), capsys)   # no KL term
    assert code == 0 and "--ref-load is unused" in err


def test_ref_update_interval_and_its_resume(assets, tmp_path):
    """--ref-update-interval 1: each rollout's reference is the actor it starts from, so the KL of its one
    optimizer step is 0; without it the KL grows from rollout 2 on. With 2, a run resumed after iteration 3
    restores iteration 2's actor as its reference and ends exactly like the uninterrupted run."""
    every = train(assets, tmp_path, "every", *KL, "--ref-update-interval", "1", num_rollout="3")
    assert [m["train/kl_loss"] for m in metrics(every)] == pytest.approx([0, 0, 0], abs=1e-6)
    never = train(assets, tmp_path, "never", *KL, num_rollout="3")
    assert abs(metrics(never)[2]["train/kl_loss"]) > 1e-4

    whole = train(assets, tmp_path, "whole", *KL, "--ref-update-interval", "2", "--save-interval", "1",
                  num_rollout="4")
    part = train(assets, tmp_path, "part", *KL, "--ref-update-interval", "2", "--save-interval", "1",
                 num_rollout="3")
    assert main(argv(assets, part, *KL, "--ref-update-interval", "2", "--save", str(tmp_path / "part_ck"),
                     "--load", str(tmp_path / "part_ck"), num_rollout="4")) == 0
    assert [m["train/kl_loss"] for m in metrics(part)] == pytest.approx([m["train/kl_loss"] for m in metrics(whole)],
                                                                        rel=1e-4, abs=1e-7)
    assert_same_training(assets, tmp_path, "whole", "part")


def test_reset_optimizer_states(assets, tmp_path):
    """Adam's first step moves every weight with a gradient by exactly lr (m/sqrt(v) = +-1); with the state
    reset before each rollout the second rollout's step is a first step too, without it it is not."""
    def unit_moves(name: str) -> float:
        w1 = weights_at(tmp_path / f"{name}_ck", 1)
        w2 = weights_at(tmp_path / f"{name}_ck", 2)
        delta = torch.cat([(w2[k] - w1[k]).abs().flatten() for k in w1])
        moved = delta[delta > 0]
        return float(((moved / 1e-2 - 1).abs() < 0.02).float().mean())

    def weights_at(save: Path, it: int) -> dict[str, torch.Tensor]:
        from furlong.checkpoint.store import load_model_weights
        from furlong.models.hf_io import load_pretrained
        model = load_pretrained(assets / "ckpt", dtype=torch.float32)
        load_model_weights(save, model, it)
        return {k: v.clone() for k, v in model.state_dict().items()}

    train(assets, tmp_path, "reset", "--reset-optimizer-states", "--save-interval", "1")
    train(assets, tmp_path, "keep", "--save-interval", "1")
    assert unit_moves("reset") > 0.95
    assert unit_moves("keep") < 0.5


# ------------------------------------------------------------------ user loss and reward functions

@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """Runs with furlong's own loss variants, trained once for the equivalence tests below."""
    d = tmp_path_factory.mktemp("loss_runs")
    for name, extra in (("base", ()), ("tis", ("--use-tis", "--tis-clip", "1.001", "--tis-clip-low", "0.999")),
                        ("drgrpo", ("--loss-agg-mode", "seq-mean-token-sum-norm"))):
        train(assets, d, name, *extra)
    return d


@pytest.mark.parametrize("name,base,extra", [
    ("custom_loss", "base", ("--loss-type", "custom_loss", "--custom-loss-function-path", FNS + "ppo_loss")),
    ("custom_tis", "tis", ("--use-tis", "--tis-clip", "1.001", "--tis-clip-low", "0.999",
                           "--custom-tis-function-path", FNS + "vanilla_tis")),
    ("reducer", "base", ("--custom-pg-loss-reducer-function-path", FNS + "sample_mean_reducer")),
    ("drgrpo_reducer", "drgrpo", ("--custom-pg-loss-reducer-function-path", FNS + "constant_divisor_reducer")),
    ("rewards", "base", ("--custom-reward-post-process-path", FNS + "grpo_rewards")),
])
def test_user_function_trains_like_furlongs_own(assets, runs, name, base, extra):
    train(assets, runs, name, *extra)
    assert_same_training(assets, runs, base, name)


@pytest.mark.parametrize("extra,needles", [
    (("--loss-type", "custom_loss", "--custom-loss-function-path", FNS + "loss_returning_text"),
     ["--custom-loss-function-path", "loss_returning_text", "must return (loss, metrics"]),
    (("--loss-type", "custom_loss", "--custom-loss-function-path", FNS + "loss_with_unknown_metric"),
     ["loss_with_unknown_metric", "'my_metric'"]),
    (("--use-tis", "--custom-tis-function-path", FNS + "tis_dropping_masks"),
     ["--custom-tis-function-path", "tis_dropping_masks", "loss_masks"]),
    (("--custom-reward-post-process-path", FNS + "rewards_too_short"),
     ["--custom-reward-post-process-path", "rewards_too_short", "expected a list of 4"]),
    (("--custom-tis-function-path", FNS + "vanilla_tis"), ["--custom-tis-function-path", "needs --use-tis"]),
    (("--custom-loss-function-path", FNS + "ppo_loss"), ["--loss-type", "custom_loss"]),
    (("--custom-pg-loss-reducer-function-path", "tests.no_such_module.f"), ["--custom-pg-loss-reducer-function-path",
                                                                           "cannot import"]),
])
def test_bad_user_function_is_one_line(assets, tmp_path, capsys, extra, needles):
    code, _, err = run_cli(argv(assets, tmp_path / "run", *extra), capsys)
    assert code == 2
    one_line(err, *needles)


@pytest.mark.parametrize("name,extra", [
    ("loss_negated", ("--loss-type", "custom_loss", "--custom-loss-function-path", FNS + "ppo_loss_negated")),
    ("tis_zero", ("--use-tis", "--custom-tis-function-path", FNS + "tis_zero")),
    ("first_tokens", ("--custom-pg-loss-reducer-function-path", FNS + "first_tokens_reducer")),
    ("rewards_reversed", ("--custom-reward-post-process-path", FNS + "reversed_rewards")),
])
def test_user_function_that_changes_the_objective_changes_the_training(assets, runs, name, extra):
    train(assets, runs, name, *extra)
    w, base, start = weights(assets, runs / f"{name}_ck"), weights(assets, runs / "base_ck"), weights_start(assets)
    assert any(not torch.allclose(w[k], base[k], rtol=1e-4, atol=1e-6) for k in w)
    if name == "tis_zero":   # no policy term: nothing moves
        assert all(torch.equal(w[k], start[k]) for k in w)
