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
