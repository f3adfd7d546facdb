"""miles' reward and metric flags: --rm-type f1 / random / deterministic_random / boxed_*, --group-rm,
--eval-reward-key, --log-passrate, --log-reward-category, --get-mismatch-metrics (units, then tiny
`furlong train` runs on CPU that exercise each)."""
from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_helpers import one_line, run_cli, tiny_assets  # noqa: E402

from furlong.algorithms.losses import kl_penalty  # noqa: E402
from furlong.algorithms.mismatch import mismatch_metrics  # noqa: E402
from furlong.cli import main  # noqa: E402
from furlong.rewards.miles_rules import boxed_content, f1_score  # noqa: E402
from furlong.rewards.registry import get_reward_fn, get_scorer  # noqa: E402
from furlong.run.reward_metrics import pass_at_k  # noqa: E402
from furlong.types import Prompt, Sample  # noqa: E402

REW = "tests.rewards_for_miles_flags."


def _sample(text: str, ids=(5, 6), index: int = 0) -> Sample:
    return Sample(prompt=Prompt(0, "q", "q", [1, 2], "cat"), group_id=0, index=index, response_ids=list(ids),
                  response_text=text, rollout_log_probs=[0.0] * len(ids), finish_reason="stop")


def test_f1_and_boxed_follow_miles():
    assert f1_score("The cat sat.", "a cat") == pytest.approx(2 * (1 / 2) * 1 / (1 / 2 + 1))
    assert f1_score("yes", "no") == 0.0 and f1_score("dog", "cat") == 0.0 and f1_score("Cat!", "cat") == 1.0
    assert boxed_content(r"x \boxed{a{b}} y \boxed{c}") == "c"
    assert boxed_content(r"\boxed{1} then \boxed{2") is None      # miles: the last box, unclosed -> nothing
    assert boxed_content(r"\fbox{3}") is None and boxed_content("none") is None
    assert get_scorer("boxed_f1")(r"so \boxed{the cat}", "cat") == 1.0
    assert get_scorer("boxed_f1")("the cat", "cat") == 0.0       # no box: scored on ""
    # as in miles: math then looks for an answer in the bare "4" and finds no box, so this scores 0
    assert get_scorer("boxed_math")(r"\boxed{4}", "4") == 0.0 and get_scorer("boxed_dapo")("x", "4") == -1.0
    with pytest.raises(ValueError, match="--rm-type: unknown reward 'boxed_nope'"):
        get_scorer("boxed_nope")


def test_random_rewards_are_seeded_and_deterministic_random_hashes_the_sample():
    def draws(seed: int) -> list[float]:
        fn = get_reward_fn("random", None, seed)
        return [fn(_sample("x")) for _ in range(40)]
    assert draws(1) == draws(1) and draws(1) != draws(2) and set(draws(1)) == {0.0, 1.0}
    s = _sample("hello", ids=(7, 8))
    want = hashlib.sha256((str([1, 2, 7, 8]) + "hello").encode()).digest()[0] % 2
    assert get_reward_fn("deterministic_random", None, 1)(s) == want == get_reward_fn("deterministic_random", None, 9)(s)


def test_pass_at_k_is_the_unbiased_estimate():
    out = pass_at_k([[1, 0, 0, 0], [1, 1, 0, 0]])
    assert out["pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert out["pass@2"] == pytest.approx(((1 - math.comb(3, 2) / math.comb(4, 2)) + (1 - 1 / 6)) / 2)
    assert out["pass@4"] == 1.0 and pass_at_k([[1], [0]]) == {}


def test_mismatch_metrics_match_their_definitions():
    t, r = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.1, -1.5, -0.5])
    m = torch.tensor([1.0, 1.0, 0.0])
    out = mismatch_metrics([t], [r], [m])
    d = (t - r)[:2]
    assert out["train_rollout_logprob_abs_diff"] == pytest.approx(d.abs().mean().item())
    assert out["train_rollout_kl"] == pytest.approx(kl_penalty(r, t, "low_var_kl")[:2].mean().item())
    assert out["mis_k3_kl"] == pytest.approx((torch.exp(d) - d - 1).mean().item())
    assert out["mis_training_ppl"] == pytest.approx(math.exp(1.5))
    assert out["mis_chi2_seq"] == pytest.approx(math.exp(2 * d.sum().item()) - 1, rel=1e-5)
    two = mismatch_metrics([t, t[:1]], [r, r[:1]], [m, torch.ones(1)])   # sample mean of token means
    assert two["mis_kl"] == pytest.approx((out["mis_kl"] + (-1.1 - -1.0)) / 2)
    per_token = mismatch_metrics([t, t[:1]], [r, r[:1]], [m, torch.ones(1)], per_token=True)
    assert per_token["mis_kl"] == pytest.approx(((r - t)[:2].sum().item() - 0.1) / 3)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("reward_assets"))


def argv(a: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template", "--num-rollout", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "5",
            "--device", "cpu", "--output-dir", str(out), "--save-debug-rollout-data", *extra]


def last(out: Path) -> dict:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]


def rewards(out: Path) -> list[float]:
    return [json.loads(x)["reward"] for x in (out / "samples" / "rollout_train_1.jsonl").read_text().splitlines()]


def test_random_rm_type_through_train_is_seeded(assets, tmp_path):
    runs = {}
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        assert main(argv(assets, tmp_path / name, "--rm-type", "random", "--seed", seed)) == 0
        runs[name] = rewards(tmp_path / name)
    assert runs["a"] == runs["b"] and set(runs["a"]) <= {0.0, 1.0}
    assert main(argv(assets, tmp_path / "d", "--rm-type", "deterministic_random")) == 0
    assert main(argv(assets, tmp_path / "f", "--rm-type", "boxed_f1")) == 0
    assert rewards(tmp_path / "f") == [0.0] * 8          # a random model writes no \boxed{}


def test_group_rm_passrate_and_mismatch_through_train(assets, tmp_path):
    out = tmp_path / "g"
    assert main(argv(assets, out, "--custom-rm-path", REW + "group_index_reward", "--group-rm", "--log-passrate",
                     "--get-mismatch-metrics")) == 0
    assert rewards(out) == [1.0, 1.0, 0.0, 0.0] * 2
    m = last(out)
    assert m["passrate/pass@1"] == 0.5 and m["passrate/pass@4"] == 1.0
    assert m["passrate/pass@2"] == pytest.approx(1 - 1 / 6)
    # same weights in engine and trainer: the gap is float noise
    assert abs(m["train/train_rollout_logprob_abs_diff"]) < 1e-3 and abs(m["train/mis_k3_kl"]) < 1e-4


def test_reward_keys_and_categories_through_train(assets, tmp_path, capsys):
    out = tmp_path / "k"
    code, _, err = run_cli(argv(assets, out, "--custom-rm-path", REW + "scores", "--reward-key", "acc",
                                "--eval-reward-key", "len", "--log-reward-category", "cat", "--log-passrate",
                                "--eval-prompt-data", "t", str(assets / "data" / "test.parquet"),
                                "--rollout-max-response-len", "5"), capsys)
    assert code == 0, err
    m = last(out)
    assert m["rollout/raw_reward"] == 0.5 and m["rollout/error_cat/ok"] == 0.5
    assert sum(v for k, v in m.items() if k.startswith("rollout/error_cat/")) == pytest.approx(1.0)
    ev = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x][0]
    assert ev["eval/t"] == 0.05                         # len / 100 of 5-token responses, not acc
    assert ev["eval/t/error_cat/ok"] == 1.0             # eval samples are index 0: acc 1
    code, _, err = run_cli(argv(assets, tmp_path / "x", "--rm-type", "math", "--log-reward-category", "cat"), capsys)
    assert code == 2
    one_line(err, "--log-reward-category", "--reward-key")


def test_group_rm_without_custom_reward_is_noted(assets, tmp_path, capsys):
    code, _, err = run_cli(argv(assets, tmp_path / "n", "--rm-type", "math", "--group-rm"), capsys)
    assert code == 0 and "furlong: note: --group-rm: no effect without --custom-rm-path" in err
