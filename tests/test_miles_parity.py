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


def _drgrpo_step(mode: str, logp: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, kl_coef: float):
    from furlong.algorithms.losses import LossConfig, rl_loss
    from furlong.trainer.batching import pack_micro_batch, step_loss_weights, step_metric_weights
    from furlong.types import TrainSample
    r = logp.numel()
    s = TrainSample(token_ids=torch.arange(r + 1), num_prompt_tokens=1, advantages=torch.ones(r),
                    rollout_log_probs=old.clone(), old_log_probs=old.clone(), ref_log_probs=ref.clone())
    mb = pack_micro_batch([s], step_loss_weights([s], mode, False, 1000), [0], step_metric_weights([s], mode))
    cfg = LossConfig(eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None, use_kl_loss=True, kl_loss_coef=kl_coef,
                     kl_loss_type="k1", entropy_coef=0.0, use_tis=False, tis_clip=2.0, tis_clip_low=0.0,
                     use_unbiased_kl=False, sequence_ratio=False)
    full = torch.zeros(r + 1)
    full[:r] = logp                       # position t predicts token t+1: response token j at position j
    return rl_loss(mb, full, None, cfg)


def test_drgrpo_reducer_changes_only_the_policy_term():
    # One sample, 3 tokens, advantage 1, ratio 1, k1 KL log-ratio 1, --kl-loss-coef 0.5, L = 1000:
    # miles 0.4970 = -3/1000 (policy, Dr.GRPO's constant) + 0.5 * mean(KL) (a plain token mean)
    logp = torch.full((3,), -1.0)
    loss, _ = _drgrpo_step("seq-mean-token-sum-norm", logp, logp.clone(), logp - 1.0, 0.5)
    assert loss.item() == pytest.approx(0.4970, abs=1e-6)
    loss, _ = _drgrpo_step("seq-mean-token-mean", logp, logp.clone(), logp - 1.0, 0.5)
    assert loss.item() == pytest.approx(-1.0 + 0.5, abs=1e-6)


def test_drgrpo_metrics_are_plain_token_means():
    # two of three tokens on the clipped branch: pg_clipfrac reads 2/3 whatever the reducer, not 2/3000
    old = torch.full((3,), -1.0)
    logp = old + torch.tensor([0.0, 0.5, 0.6])          # ratios 1, 1.65, 1.82 > 1 + 0.2 with A = 1
    for mode in ("seq-mean-token-sum-norm", "seq-mean-token-mean"):
        _, m = _drgrpo_step(mode, logp, old, old.clone(), 0.0)
        assert m.pg_clipfrac.item() == pytest.approx(2 / 3, rel=1e-6), mode
        assert m.ppo_kl.item() == pytest.approx(-(0.5 + 0.6) / 3, rel=1e-5), mode
