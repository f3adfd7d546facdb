"""The Python API builds the run the CLI builds: same flags and functions (callables vs module paths),
same seed -> the same metrics and the same trained weights; the TRL reward adapter's call shape."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

from furlong import api  # noqa: E402
from furlong.cli import main  # noqa: E402
from furlong.types import Prompt, Sample  # noqa: E402
from tests import generate_for_tests, rewards_for_tests  # noqa: E402


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from furlong.tasks.synthetic import prepare_synthetic
    d = tmp_path_factory.mktemp("api")
    write_tiny_checkpoint(d / "ckpt", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1)
    prepare_synthetic(d / "data", 8, 2, 0)
    return d


def flags(a: Path, out: Path) -> list[str]:
    return ["--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template", "--num-rollout", "2",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "12",
            "--lr", "1e-3", "--device", "cpu", "--output-dir", str(out), "--save", str(out / "ckpt")]


def run_result(out: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from furlong.checkpoint.store import load_model_weights
    from furlong.models.hf_io import load_pretrained
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not k.startswith(("perf/", "memory/", "time"))} for r in rows]
    model = load_pretrained(ASSETS["ckpt"], dtype=torch.float32, device="cpu")
    load_model_weights(out / "ckpt", model)
    return rows, {k: v.clone() for k, v in model.state_dict().items()}


ASSETS: dict[str, Path] = {}


def test_api_run_equals_cli_run(assets, tmp_path):
    ASSETS["ckpt"] = assets / "ckpt"
    cli_out, api_out = tmp_path / "cli", tmp_path / "api"
    assert main(["train", *flags(assets, cli_out), "--custom-rm-path", "tests.rewards_for_tests.index_reward",
                 "--custom-generate-function-path", "tests.generate_for_tests.two_turns"]) == 0
    assert api.train(flags(assets, api_out), reward=rewards_for_tests.index_reward,
                     generate=generate_for_tests.two_turns) == 0
    cli_rows, cli_w = run_result(cli_out)
    api_rows, api_w = run_result(api_out)
    assert len(cli_rows) == 2 and cli_rows == api_rows
    assert cli_rows[0]["rollout/turns/mean"] == 2.0
    for k in cli_w:
        assert torch.equal(cli_w[k], api_w[k]), k


def test_api_errors_are_exceptions_naming_the_flag(assets, tmp_path):
    with pytest.raises(ValueError, match="--rm-type"):
        api.train(flags(assets, tmp_path / "r"))                       # no reward at all
    with pytest.raises(ValueError, match="--custom-generate-function-path: .* must be an async function"):
        api.train(flags(assets, tmp_path / "r"), reward=rewards_for_tests.index_reward,
                  generate=generate_for_tests.not_async)


def test_trl_reward_adapter():
    seen = {}

    def trl_fn(completions, prompts, **kwargs):
        seen.update(completions=completions, prompts=prompts, **kwargs)
        return [float(kwargs["solution"][0] in completions[0][0]["content"])]

    prompt = Prompt(row=0, raw=[{"role": "user", "content": "2+2?"}], text="<|im_start|>user...", token_ids=[1],
                    label="4", metadata={"difficulty": 1})
    s = Sample(prompt=prompt, group_id=0, index=0, response_ids=[7, 8], response_text="it is 4",
               rollout_log_probs=[0.0, 0.0], finish_reason="stop")
    assert api.trl_reward(trl_fn, label_name="solution")(s) == 1.0
    assert seen["prompts"] == [prompt.raw] and seen["completion_ids"] == [[7, 8]] and seen["difficulty"] == [1]
    with pytest.raises(ValueError, match="one reward per completion"):
        api.trl_reward(lambda completions, prompts, **kw: 1.0)(s)
