"""The calculator tool recipe (--custom-generate-function-path) under 2 gloo worker processes on the CPU
(--actor-num-gpus-per-node 2), end to end, against the same run in one process.

The model's first turn is scripted to call the calculator (tests/generate_for_tests.calculator_scripted_call:
a tiny random model never writes a tool call); the tool runs, its result goes in as tool tokens, and the
real engine writes the second turn in the same conversation. Each finished sample is recorded with the rank
that generated it. Checked: rank r generated exactly its contiguous share of each rollout's groups
(rollout.rank_share) and the two ranks' samples together are the one-process run's, token for token
(a sample's seed depends on neither the rank count nor the batching; the log-probs of rollout 2, made
with weights the ranks trained, up to float32 reduction order); the loss mask is 0 on exactly the
tool tokens and the rollout log-probs are 0 there; the trained-token metric counts only mask-1 tokens; and
both ranks hold the same gathered batch in the same order (recorded by a keep-all filter, which
every rank runs on the gathered groups) and the logged rank split is the planner's for it; and the
training the two ranks split between them equals one process's (metrics and final weights, up to
float32 reduction order, as in tests/test_multinode.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from generate_for_tests import RECORD_ENV, SCRIPTED_CALL  # noqa: E402
from tiny_checkpoints import build_tokenizer, write_tiny_checkpoint  # noqa: E402

from furlong.cli import main  # noqa: E402
from furlong.rollout.rollout import rank_share  # noqa: E402
from furlong.trainer.planning import rank_micro_batches  # noqa: E402
from furlong.types import DistContext  # noqa: E402

NUM_ROLLOUT, NUM_PROMPTS, N = 2, 4, 2
TOOL_TEXT = "\n<|im_start|>tool\n83810205<|im_end|>\n<|im_start|>assistant\n"   # 12345 * 6789, as rendered
PER_RANK = ("train/num_micro_batches", "train/tokens_max_over_mean")   # this rank's share, by definition


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from furlong.tasks.calculator_task import prepare_calculator_task
    d = tmp_path_factory.mktemp("calc_ranks")
    write_tiny_checkpoint(d / "ckpt", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1)
    prepare_calculator_task(d / "data", 16, 2, seed=0, digits=5)
    return d


def argv(a: Path, run: Path, *extra: str) -> list[str]:
    # hash_reward differs within groups, so the advantages are non-zero and the weights move
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template", "--tool-key", "tools",
            "--apply-chat-template-kwargs", '{"enable_thinking": false}', "--rollout-shuffle",
            "--custom-generate-function-path", "tests.generate_for_tests.calculator_scripted_call",
            "--custom-rm-path", "tests.rewards_for_tests.hash_reward", "--num-rollout", str(NUM_ROLLOUT),
            "--rollout-batch-size", str(NUM_PROMPTS), "--n-samples-per-prompt", str(N),
            "--rollout-max-response-len", "12", "--rollout-max-context-len", "480", "--lr", "1e-2",
            "--dynamic-sampling-filter-path", "tests.generate_for_tests.record_batch_filter",
            "--device", "cpu", "--output-dir", str(run / "out"), "--save", str(run / "ck"), *extra]


def generated(run: Path, rank: int) -> list[list[dict]]:
    """The samples rank `rank` generated, per rollout (N per group, in the order they finished)."""
    rows = [json.loads(x) for x in (run / "out" / f"generated_rank{rank}.jsonl").read_text().splitlines()]
    per = len(rows) // NUM_ROLLOUT
    assert per * NUM_ROLLOUT == len(rows)
    return [sorted(rows[i * per:(i + 1) * per], key=lambda r: (r["group"], r["index"])) for i in range(NUM_ROLLOUT)]


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "out" / "metrics.jsonl").read_text().splitlines()]


def final_weights(run: Path, assets: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    assert main(["export", "--load", str(run / "ck"), "--output", str(run / "hf"), "--hf-checkpoint",
                 str(assets / "ckpt")]) == 0
    return load_file(str(next((run / "hf").glob("*.safetensors"))))


def batches(run: Path, rank: int) -> list[list[dict]]:
    """The batch rank `rank` held after each rollout's gather: groups in its order (record_batch_filter)."""
    rows = [json.loads(x) for x in (run / f"batch_rank{rank}.jsonl").read_text().splitlines()]
    return [rows[i * NUM_PROMPTS:(i + 1) * NUM_PROMPTS] for i in range(NUM_ROLLOUT)]


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory):
    run = tmp_path_factory.mktemp("one")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RECORD_ENV, str(run))
        assert main(argv(assets, run)) == 0
    return run


@pytest.fixture(scope="module")
def two_ranks(assets, tmp_path_factory):
    run = tmp_path_factory.mktemp("two")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           RECORD_ENV: str(run)}
    p = subprocess.run([sys.executable, "-m", "furlong", *argv(assets, run, "--actor-num-gpus-per-node", "2")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    return run


def test_each_rank_generates_its_share_and_together_the_one_process_samples(one_process, two_ranks):
    alone = generated(one_process, 0)
    by_rank = [generated(two_ranks, r) for r in (0, 1)]
    for rollout in range(NUM_ROLLOUT):
        for r in (0, 1):
            share = rank_share(NUM_PROMPTS, DistContext(rank=r, world_size=2, local_rank=r,
                                                        device=torch.device("cpu"), backend="gloo"))
            assert [(x["group"], x["index"]) for x in by_rank[r][rollout]] == [
                (g, j) for g in range(share.start, share.stop) for j in range(N)]
        together = sorted(by_rank[0][rollout] + by_rank[1][rollout], key=lambda x: (x["group"], x["index"]))
        exact = ("group", "index", "prompt_ids", "response_ids", "loss_mask", "num_tool_calls")
        assert [{k: x[k] for k in exact} for x in together] == [{k: x[k] for k in exact} for x in alone[rollout]]
        # rollout 2 runs on weights trained by two ranks: equal up to float32 reduction order (docstring)
        for x, y in zip(together, alone[rollout]):
            assert x["rollout_log_probs"] == pytest.approx(y["rollout_log_probs"], abs=1e-5)


def test_both_ranks_hold_the_same_batch_and_train_the_planned_split(one_process, two_ranks):
    """After each gather the two ranks hold the same groups in the same order (the trainer's rank split
    indexes that list on every rank), the one-process batch up to order; the split the trainer logs is
    the planner's for those lengths: disjoint, covering, balanced as reported."""
    for rollout, (b0, b1, alone) in enumerate(zip(batches(two_ranks, 0), batches(two_ranks, 1),
                                                  batches(one_process, 0))):
        assert b0 == b1
        key = lambda g: g["group"]   # noqa: E731
        assert sorted(b0, key=key) == sorted(alone, key=key)          # tokens, masks, rewards
        lengths = [len(s["tokens"]) for g in b0 for s in g["samples"]]
        split, plans = rank_micro_batches(lengths, 2, None, 1)       # --micro-batch-size 1, no dynamic batching
        assert sorted(i for idx in split for i in idx) == list(range(len(lengths)))
        rank_tokens = [sum(lengths[i] for i in idx) for idx in split]
        m = metrics(two_ranks)[rollout]
        assert m["train/num_micro_batches"] == max(len(p) for p in plans) < len(lengths)
        assert m["train/tokens_max_over_mean"] == pytest.approx(max(rank_tokens) / (sum(rank_tokens) / 2))
        assert metrics(one_process)[rollout]["train/num_micro_batches"] == len(lengths)


def test_loss_masks_hold_on_both_ranks(one_process, two_ranks):
    tok = build_tokenizer()
    call = tok(SCRIPTED_CALL, add_special_tokens=False)["input_ids"]
    tool = tok(TOOL_TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(tool) == TOOL_TEXT
    for run in (one_process, two_ranks):
        rows = [x for r in ((0, 1) if run is two_ranks else (0,)) for per in generated(run, r) for x in per]
        assert len(rows) == NUM_ROLLOUT * NUM_PROMPTS * N
        for x in rows:
            ids, mask, lps = x["response_ids"], x["loss_mask"], x["rollout_log_probs"]
            assert x["num_tool_calls"] == 1 and ids[:len(call) + len(tool)] == call + tool
            second = len(ids) - len(call) - len(tool)
            assert second >= 1                                   # the engine's own turn after the tool
            assert mask == [1] * len(call) + [0] * len(tool) + [1] * second
            assert all(lp == 0.0 for lp, m in zip(lps, mask) if m == 0)
            assert any(lp < 0.0 for lp in lps[len(call) + len(tool):])   # the engine's log-probs, not filler
        for step, m in enumerate(metrics(run)):
            per_step = [x for r in ((0, 1) if run is two_ranks else (0,)) for x in generated(run, r)[step]]
            assert m["rollout/trained_tokens/mean"] == pytest.approx(
                sum(sum(x["loss_mask"]) for x in per_step) / len(per_step))
            assert m["rollout/turns/mean"] == 2.0


def test_two_ranks_train_as_one_process(assets, one_process, two_ranks):
    a, b = metrics(two_ranks), metrics(one_process)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(NUM_ROLLOUT))
    for ra, rb in zip(a, b):
        keys = [k for k in rb if not k.startswith(("perf/", "memory/")) and k not in PER_RANK]
        assert set(keys) <= set(ra)
        for k in keys:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (ra["step"], k)
    assert b[0]["train/grad_norm"] > 0                           # it trained on something
    wa, wb = final_weights(two_ranks, assets), final_weights(one_process, assets)
    base = final_weights_before(assets)
    assert wa.keys() == wb.keys()
    assert any(not torch.equal(wb[k], base[k]) for k in wb)      # the weights moved
    # Adam's g / sqrt(v) magnifies reduction-order noise on entries whose gradient is near 0 (measured:
    # 1 entry of 4096 off by 1.2e-5, the rest <= 5e-6); the steps moved the weights by 2e-2, and a rank
    # training on the wrong share would be off by that much
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-4, msg=k)


def final_weights_before(assets: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(next((assets / "ckpt").glob("*.safetensors"))))
