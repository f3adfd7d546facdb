"""Differences a side-by-side with miles' own functions found (issue: miles recipes run unchanged),
each pinned on its minimal input: furlong now computes what miles computes."""
from __future__ import annotations

import math

import pytest
import torch

from furlong.algorithms.losses import kl_penalty
from furlong.cli import parse_config
from furlong.rewards.dapo import dapo_score


def test_unbiased_low_var_kl_clamps_the_product_as_miles():
    # One token: logp -4, ref -1, old -3.3069 (ratio 0.5). k3 = e^3 - 1 - 3 = 16.09; miles clamps
    # ratio * k3 = 8.04 (inside [-10, 10]); clamping k3 first would give 0.5 * 10 = 5.00.
    logp, ref, old = torch.tensor([-4.0]), torch.tensor([-1.0]), torch.tensor([-4.0 - math.log(0.5)])
    ratio = torch.exp(logp - old)
    k3 = math.exp(3.0) - 1 - 3.0
    got = kl_penalty(logp, ref, "low_var_kl", ratio).item()
    assert got == pytest.approx(0.5 * k3, rel=1e-5)
    assert got == pytest.approx(8.04, abs=0.01)
    # The product is still clamped: ratio 1 gives the clamp value, not 16.09.
    assert kl_penalty(logp, ref, "low_var_kl", torch.ones(1)).item() == 10.0
    assert kl_penalty(logp, ref, "low_var_kl").item() == 10.0
    # Other estimators take the ratio unclamped.
    assert kl_penalty(logp, ref, "k1", ratio).item() == pytest.approx(-1.5, rel=1e-6)


def test_rollout_logprobs_with_tis_is_refused(tmp_path):
    argv = ["--hf-checkpoint", str(tmp_path), "--prompt-data", str(tmp_path / "x.jsonl"),
            "--rm-type", "math", "--use-rollout-logprobs", "--use-tis"]
    with pytest.raises(ValueError, match=r"^--use-tis: .*--use-rollout-logprobs"):
        parse_config(argv)
    parse_config(argv[:-1])   # either alone is accepted
    parse_config(argv[:-2] + ["--use-tis"])


@pytest.mark.parametrize("label,answer", [("-1,000", "-1000"), ("-1000", "-1,000"), ("1,000", "1000"),
                                          ("-12,345,678", "-12345678")])
def test_dapo_thousands_separators_of_negative_numbers(label, answer):
    assert dapo_score(f"so ... Answer: {answer}", label) == 1.0


def test_dapo_commas_that_are_not_grouping_stay():
    assert dapo_score("Answer: 1,2,x", "12") == -1.0
    assert dapo_score("Answer: -1000", "-1001") == -1.0


def test_kv_cache_dtype_flag_and_miles_alias(tmp_path):
    base = ["--hf-checkpoint", str(tmp_path), "--prompt-data", str(tmp_path / "x.jsonl"), "--rm-type", "math"]
    assert parse_config(base).rollout.rollout_kv_dtype == "auto"
    assert parse_config(base + ["--sglang-kv-cache-dtype", "fp8_e4m3"]).rollout.rollout_kv_dtype == "fp8_e4m3"
    assert parse_config(base + ["--rollout-kv-dtype", "bf16"]).rollout.rollout_kv_dtype == "bf16"
    with pytest.raises(ValueError, match=r"^--rollout-kv-dtype: unknown KV cache dtype 'int4'"):
        parse_config(base + ["--rollout-kv-dtype", "int4"])


def test_train_with_fp8_kv_cache_on_cpu(tmp_path, capsys):
    """The flag reaches the engine: one CPU rollout + train step with an fp8 KV cache."""
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_cli import REWARD, run_cli  # noqa: E402
    from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

    from furlong.tasks.synthetic import prepare_synthetic
    write_tiny_checkpoint(tmp_path / "ckpt", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1)
    prepare_synthetic(tmp_path / "data", 8, 2, 0)
    out = tmp_path / "out"
    code, _, err = run_cli(["train", "--hf-checkpoint", str(tmp_path / "ckpt"),
                            "--prompt-data", str(tmp_path / "data" / "train.parquet"), "--input-key", "messages",
                            "--label-key", "label", "--apply-chat-template", "--custom-rm-path", REWARD,
                            "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                            "--rollout-max-response-len", "8", "--device", "cpu", "--output-dir", str(out),
                            "--sglang-kv-cache-dtype", "fp8_e4m3"], capsys)
    assert code == 0, err
    line = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["rollout/response_len/mean"] > 0
    assert json.loads((out / "config.json").read_text())["rollout"]["rollout_kv_dtype"] == "fp8_e4m3"
