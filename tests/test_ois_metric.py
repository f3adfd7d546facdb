"""miles' `ois` (--get-mismatch-metrics / --use-tis): the mean over trained tokens of exp(logp - old),
on a minimal input computed by hand, and through `furlong train` on CPU."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_helpers import tiny_assets  # noqa: E402

from furlong.algorithms.losses import rl_loss  # noqa: E402
from furlong.cli import main  # noqa: E402
from furlong.config import Config  # noqa: E402
from furlong.config_map import loss_config  # noqa: E402
from furlong.trainer.batching import pack_micro_batch, token_loss_weights  # noqa: E402
from furlong.types import TrainSample  # noqa: E402


def _batch(old: list[float], mask: list[float] | None):
    """One sample: a 2-token prompt and len(old) response tokens with these old log-probs."""
    r = len(old)
    s = TrainSample(token_ids=torch.arange(2 + r), num_prompt_tokens=2, advantages=torch.ones(r),
                    rollout_log_probs=torch.tensor(old), old_log_probs=torch.tensor(old),
                    loss_mask=None if mask is None else torch.tensor(mask))
    return pack_micro_batch([s], token_loss_weights([s], 1, False, 0), [0])


@pytest.mark.parametrize("sequence_ratio", [False, True])
def test_ois_by_hand(sequence_ratio):
    # response log-probs logp = [-1, -2, -3], old = [-1.5, -1, -3]; the third token is masked out.
    # per token: ratio exp(0.5) = 1.6487, exp(-1) = 0.3679 -> mean over trained tokens 1.0083.
    # GSPO: every token takes the sequence ratio exp(mean(0.5, -1)) = exp(-0.25) = 0.7788.
    mb = _batch([-1.5, -1.0, -3.0], [1.0, 1.0, 0.0])
    lp = torch.zeros(mb.input_ids.numel())
    lp[1:4] = torch.tensor([-1.0, -2.0, -3.0])   # position p predicts token p + 1: the response is at 1..3
    prm = dataclasses.replace(loss_config(Config()), sequence_ratio=sequence_ratio)
    _, m = rl_loss(mb, lp, None, prm)
    want = math.exp(-0.25) if sequence_ratio else (math.exp(0.5) + math.exp(-1.0)) / 2
    assert m.ois.item() == pytest.approx(want, rel=1e-6)
    assert m.ppo_kl.item() == pytest.approx(0.25, rel=1e-6)   # old - logp averaged: its exp is not ois


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("ois_assets"))


def last(out: Path) -> dict:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]


def test_ois_through_train(assets, tmp_path):
    def run(name: str, *extra: str) -> dict:
        argv = ["train", "--hf-checkpoint", str(assets / "ckpt"), "--prompt-data", str(assets / "data" / "train.parquet"),
                "--input-key", "messages", "--label-key", "label", "--apply-chat-template",
                "--custom-rm-path", "tests.rewards_for_tests.index_reward", "--num-rollout", "1",
                "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
                "--lr", "1e-2", "--device", "cpu", "--output-dir", str(tmp_path / name), *extra]
        assert main(argv) == 0
        return last(tmp_path / name)
    assert "train/ois" not in run("plain")
    # one optimizer step: old log-probs are the training forward's own, the ratio exactly 1
    assert run("one", "--get-mismatch-metrics")["train/ois"] == pytest.approx(1.0, abs=1e-6)
    # two steps with a no-grad old pass: the second step's policy has moved, so the mean ratio is not 1
    two = run("two", "--use-tis", "--global-batch-size", "2")
    assert two["train/num_steps"] == 2 and two["train/ois"] != pytest.approx(1.0, abs=1e-6)
