"""Partial rollouts (--partial-rollout, --mask-offpolicy-in-partial-rollout) on the CPU with a tiny random Qwen3.

A paused sample resumed later yields the tokens of an unpaused one (unchanged weights), in the engine and
through the rollout; every group drawn is filtered at most once and is kept, dropped, aborted or still
paused; tokens are counted once; the mask flag zeroes exactly the off-policy tokens' loss; paused groups
survive a checkpoint and resume through `furlong train`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from cli_helpers import run_cli, tiny_assets
from tiny_checkpoints import write_tiny_checkpoint

from furlong.algorithms.losses import LossConfig, rl_loss
from furlong.algorithms.shaping import ShapingConfig
from furlong.engine import Engine, EngineConfig, Request, SamplingParams
from furlong.models.hf_io import load_pretrained
from furlong.rollout.filters import GroupFilter
from furlong.rollout.partial import START_KEY, PausedGroups
from furlong.rollout.rollout import RolloutConfig, generate_rollout
from furlong.run import step
from furlong.trainer.batching import pack_micro_batch, step_loss_weights
from furlong.types import Prompt

EOS = 2


@pytest.fixture(scope="module")
def model_tok(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3", vocab_size=128, hidden=64,
                                 layers=2, heads=4, kv_heads=2, seed=0)
    return load_pretrained(path, dtype=torch.float32, device="cpu"), AutoTokenizer.from_pretrained(path)


class CountingEngine(Engine):
    """The engine, recording the tokens its stats counted in each rollout (reset_stats)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.tokens_per_take: list[int] = []

    def reset_stats(self):
        stats = super().reset_stats()
        self.tokens_per_take.append(stats.num_generated_tokens)
        return stats


def make_engine(model_tok, cls=Engine) -> Engine:
    model, tok = model_tok
    return cls(model, tok, [EOS], EngineConfig(page_size=8, decode_window=4, max_num_seqs=16, cpu_kv_tokens=4096,
                                               max_model_len=64, cascade_min_prefix=1))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_resume_continues_as_if_never_paused(model_tok, temperature):
    prompt = model_tok[1]("What is 2 + 3?")["input_ids"]
    params = SamplingParams(temperature=temperature, max_new_tokens=20, ignore_eos=True, stop=["~~"])
    whole = make_engine(model_tok).generate([Request(0, prompt, params, n=3, seed=11)])[0]
    eng = make_engine(model_tok)
    eng.add(Request(0, prompt, params, n=3, seed=11))
    for _ in range(3):               # the prefill and two windows of 4: 9 tokens each
        eng.step()
    parts = sorted(eng.abort({0}), key=lambda c: c.index)
    assert [len(c.token_ids) for c in parts] == [9, 9, 9] and {c.finish_reason for c in parts} == {"abort"}
    eng.release()
    again = eng.generate([Request(1 + j, prompt, params, seed=11, resume_ids=c.token_ids, resume_log_probs=c.log_probs,
                                  first_sample=j) for j, c in enumerate(parts)])
    for w, p, (r,) in zip(whole, parts, again):
        assert r.token_ids == w.token_ids and r.text == w.text and r.finish_reason == "length"
        assert r.log_probs[:9] == p.log_probs                      # the paused part's own log-probs, kept
        torch.testing.assert_close(torch.tensor(r.log_probs), torch.tensor(w.log_probs), atol=1e-4, rtol=0)
    if temperature > 0:
        assert len({tuple(c.token_ids) for c in whole}) == 3     # distinct noise per sample: first_sample matters


class Draws:
    """Prompts cycling through `token_ids`, each draw its own row (so a group occurrence is identifiable)."""

    def __init__(self, token_ids: list[list[int]]):
        self.token_ids, self.drawn = token_ids, 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def next_batch(self, num: int) -> list[Prompt]:
        out = [Prompt(row=r, raw="", text="", token_ids=self.token_ids[r % len(self.token_ids)], label="")
               for r in range(self.drawn, self.drawn + num)]
        self.drawn += num
        return out


# prompt lengths 2, 3, 4, 20, 21, 22 under --rollout-max-context-len 30: response caps 24, 24, 24, 10, 9, 8, so
# groups finish at different engine steps and the long ones are paused mid-way
PROMPTS = [[5 + (7 * i + k) % 90 for k in range(p)] for i, p in enumerate([2, 3, 4, 20, 21, 22])]
CFG = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=6,
                    sampling=SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True), seed=5,
                    max_context_len=30, partial_rollout=True)


def _rollouts(model_tok, cfg: RolloutConfig, num: int):
    eng = make_engine(model_tok, CountingEngine)
    data, paused, seen = Draws(PROMPTS), PausedGroups(), []

    def keep(group):
        seen.append(group.samples[0].prompt.row)
        return group.samples[0].prompt.row % 5 != 4

    batches, buffers = [], []
    for r in range(num):
        batches.append(generate_rollout(data, eng, lambda s: float(s.index), GroupFilter("row", keep), cfg, None, r,
                                        report=None, paused=paused))
        eng.release()
        buffers.append({pg.group.samples[0].prompt.row: pg for pg in paused.groups})
    return eng, data, batches, buffers, seen


def test_rollouts_resume_paused_groups_and_count_each_once(model_tok):
    eng, data, batches, buffers, seen = _rollouts(model_tok, CFG, 4)
    kept = [g.samples[0].prompt.row for b in batches for g in b.groups]
    assert len(kept) == len(set(kept)) == 8 and len(seen) == len(set(seen))      # kept once, filtered once
    final = set(buffers[-1])
    late = set(range(data.drawn)) - set(seen) - final
    assert not final & set(seen)
    assert len(late) == sum(b.metrics.num_aborted for b in batches)             # the rest: aborted, as in miles
    assert sum(b.metrics.num_generated_groups for b in batches) == len(seen) + len(late)
    for r, b in enumerate(batches):
        before = buffers[r - 1] if r else {}
        assert b.metrics.num_partial_resumed == 2 * min(len(before), 6)
        assert b.metrics.num_partial_paused == 2 * (len(buffers[r]) - max(len(before) - 6, 0))
        assert b.metrics.num_generated_tokens == eng.tokens_per_take[2 * r + 1]     # new tokens only, once
    resumed = {r: [g for g in b.groups if START_KEY in g.samples[0].metadata] for r, b in enumerate(batches)}
    assert any(g.samples[0].metadata[START_KEY] <= r - 2 for r, gs in resumed.items() for g in gs)   # paused twice
    ref = make_engine(model_tok)
    for b in batches:
        for g in b.groups:
            p = g.samples[0].prompt.token_ids
            cap = min(24, 30 - len(p))
            want = ref.generate([Request(0, p, SamplingParams(temperature=0.0, max_new_tokens=cap,
                                                              ignore_eos=True))])[0][0]
            for s in g.samples:
                assert s.response_ids == want.token_ids and s.finish_reason == "length"
                torch.testing.assert_close(torch.tensor(s.rollout_log_probs), torch.tensor(want.log_probs),
                                           atol=1e-4, rtol=0)
                assert s.loss_mask is None
            ref.release()
    assert any(resumed.values())
    state = PausedGroups()
    paused = PausedGroups()
    paused.put(list(buffers[-1].values()))
    state.load_state_dict(json.loads(json.dumps(paused.state_dict())))     # plain values only
    assert state.groups == paused.groups


def test_mask_offpolicy_zeroes_the_loss_of_earlier_tokens_exactly(model_tok):
    import dataclasses
    cfg = dataclasses.replace(CFG, mask_offpolicy=True)
    _, _, batches, buffers, _ = _rollouts(model_tok, cfg, 2)
    groups = batches[1].groups
    resumed = [g for g in groups if START_KEY in g.samples[0].metadata]
    assert resumed
    num_masked = 0
    for g in groups:
        prior = buffers[0].get(g.samples[0].prompt.row)
        for s in g.samples:
            if prior is None:
                assert s.loss_mask is None
                continue
            k = len(prior.group.samples[s.index].response_ids)
            assert 0 < k < len(s.response_ids) and s.loss_mask == [0] * k + [1] * (len(s.response_ids) - k)
            num_masked += k
    total = sum(len(s.response_ids) for g in groups for s in g.samples)
    assert batches[1].metrics.partial_offpolicy_token_frac == pytest.approx(num_masked / total)
    samples, rewards = step.train_samples(groups, ShapingConfig(None, 1.0, 24))
    step.old_log_probs(samples, None, None, "engine")
    for s, a in zip(samples, torch.randn(len(samples))):
        s.advantages = torch.full((s.num_response_tokens,), float(a))
    mb = pack_micro_batch(samples, step_loss_weights(samples, "seq-mean-token-mean", False, 24),
                          list(range(len(samples))))
    log_probs = (mb.rollout_log_probs - 0.1).requires_grad_()
    loss, _ = rl_loss(mb, log_probs, None, LossConfig(eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None,
                                                      use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1",
                                                      entropy_coef=0.0, use_tis=True, tis_clip=2.0, tis_clip_low=0.0,
                                                      use_unbiased_kl=False, sequence_ratio=False))
    loss.backward()
    trained = mb.response_mask.bool()
    assert int((mb.loss_weight > 0).sum()) == int(trained.sum()) == total - num_masked
    offpolicy = torch.cat([torch.cat([torch.zeros(s.num_prompt_tokens - 1),
                                      1 - (s.loss_mask if s.loss_mask is not None else torch.ones(s.num_response_tokens)),
                                      torch.zeros(1)]) for s in samples]).bool()
    assert int(offpolicy.sum()) == num_masked
    assert torch.all(log_probs.grad[offpolicy] == 0) and torch.all(log_probs.grad[trained] != 0)


def _train_argv(a: Path, out: Path, num_rollout: int, *extra: str) -> list[str]:
    # prompts of 165-175 tokens (the 187-token one dropped) under a 185-token context: caps of 10-16 tokens,
    # decode windows of 2, so groups finish at different steps and some are paused at every rollout
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", "tests.rewards_for_tests.index_reward", "--num-rollout", str(num_rollout),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--over-sampling-batch-size", "4",
            "--rollout-max-response-len", "16", "--rollout-max-context-len", "185", "--rollout-max-prompt-len", "184",
            "--rollout-decode-window", "2", "--partial-rollout", "--save-debug-rollout-data",
            "--lr", "1e-3", "--device", "cpu", "--output-dir", str(out), *extra]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"kind": "eval"' not in x]


def test_paused_groups_survive_checkpoint_and_resume(tmp_path, capsys):
    a = tiny_assets(tmp_path / "assets")
    assert run_cli(_train_argv(a, tmp_path / "fresh", 4), capsys)[0] == 0
    ck = tmp_path / "ck"
    assert run_cli(_train_argv(a, tmp_path / "first", 2, "--save", str(ck)), capsys)[0] == 0
    saved = torch.load(ck / "iter_0000002" / "trainer.pt", weights_only=False)["sampler"]["paused_groups"]["groups"]
    assert saved and all(len(g["samples"]) == 2 for g in saved)      # the run really paused groups here
    assert run_cli(_train_argv(a, tmp_path / "resumed", 4, "--load", str(ck)), capsys)[0] == 0
    fresh, resumed = _metrics(tmp_path / "fresh"), _metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [2, 3]
    assert resumed[0]["rollout/partial/num_resumed"] > 0
    for a_, b_ in zip(fresh[2:], resumed):
        for key in ("rollout/partial/num_resumed", "rollout/partial/num_paused", "rollout/response_len/mean",
                    "rollout/rollout_log_probs", "train/loss", "train/grad_norm"):
            assert a_[key] == b_[key], key
    for k in (3, 4):       # the same samples trained, in the same order
        name = f"samples/rollout_train_{k}.jsonl"
        assert (tmp_path / "fresh" / name).read_text() == (tmp_path / "resumed" / name).read_text()


def _dp_worker(rank: int, world: int, port: int, ckpt: str, results) -> None:
    import torch.distributed as torch_dist
    from furlong.types import DistContext
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ranks = DistContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
        eng = make_engine((load_pretrained(ckpt, dtype=torch.float32, device="cpu"), AutoTokenizer.from_pretrained(ckpt)))
        data, paused, out = Draws(PROMPTS), PausedGroups(), []
        for r in range(3):
            b = generate_rollout(data, eng, lambda s: float(s.index), None, CFG, ranks, r, report=None, paused=paused)
            eng.release()
            out.append(([(s.prompt.row, s.index, s.response_ids) for s in b.samples], b.metrics.num_partial_resumed,
                        json.dumps(paused.state_dict())))
        results[rank] = out
    finally:
        torch_dist.destroy_process_group()


def test_two_ranks_hold_the_same_batches_and_paused_groups(tmp_path):
    import socket
    import torch.multiprocessing as mp
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", family="qwen3", vocab_size=128, hidden=64, layers=2, heads=4,
                                 kv_heads=2, seed=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_dp_worker, args=(2, port, str(ckpt), results), nprocs=2, join=True)
        results = dict(results)
    assert results[0] == results[1]
    assert any(resumed for _, resumed, _ in results[0]) and json.loads(results[0][0][2])["groups"]
