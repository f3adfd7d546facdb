"""--offload-rollout-level weight: the engine's weights in one arena (engine/weight_arena.py), given back
while the trainer runs and written again by the weight update.

On the CPU the arena is a plain tensor whose storage is resized to nothing and back (on CUDA with the
driver's VM API, a StableBuffer that keeps its address; tests/test_weight_offload_gpu.py). Checked here:
the arena changes no token; released weights free their bytes and the engine refuses to run until
restored and synced; the restored engine equals a fresh one built on the synced weights; and a
`furlong train` run releases them after every rollout and ends exactly where a run without the flag
does.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from cli_helpers import one_line, run_cli, tiny_assets
from tiny_checkpoints import write_tiny_checkpoint

from furlong.checkpoint.store import load_model_weights
from furlong.engine import Engine, EngineConfig, Request, SamplingParams
from furlong.models.hf_io import load_pretrained
from furlong.run import step
from furlong.trainer.weight_sync import sync_weights

EOS = 2


def _ckpt(d: Path, seed: int) -> str:
    return str(write_tiny_checkpoint(d / f"seed{seed}", family="qwen3", vocab_size=128, hidden=64, layers=2,
                                     heads=4, kv_heads=2, seed=seed))


def _engine(path: str, offload: bool) -> Engine:
    model = load_pretrained(path, dtype=torch.float32, device="cpu")
    cfg = EngineConfig(page_size=8, decode_window=4, max_num_seqs=8, cpu_kv_tokens=2048, max_model_len=64,
                       offload_weights=offload)
    return Engine(model, AutoTokenizer.from_pretrained(path), [EOS], cfg)


def _greedy(engine: Engine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    out = engine.generate([Request(i, p, params) for i, p in enumerate([[5, 9, 17], [44, 3], [7, 7, 8, 100, 3]])])
    engine.release()
    return [c[0].token_ids for c in out]


def test_the_arena_holds_every_weight_and_changes_no_token(tmp_path):
    path = _ckpt(tmp_path, 0)
    plain, arena = _engine(path, False), _engine(path, True)
    weights = arena.runner.weights
    assert all(weights.holds(p) for p in arena.model.parameters())
    assert all(weights.holds(t) for w in arena.runner.forward.layers for t in (w.qkv_w, w.gu_w))
    assert plain.runner.weights is None
    assert _greedy(arena) == _greedy(plain)


def test_released_weights_free_their_bytes_and_the_sync_brings_them_back(tmp_path):
    """Released: the arena's storage holds no bytes and the engine refuses to start a session; restored and
    synced from other weights (a second checkpoint standing in for the trained actor): the same tokens as
    an engine built on those weights."""
    engine, trained = _engine(_ckpt(tmp_path, 0), True), _ckpt(tmp_path, 1)
    before = _greedy(engine)
    engine.release_weights()
    assert engine.runner.weights_released and engine.runner.weights.bytes.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="--offload-rollout-level weight"):
        _greedy(engine)
    written = step.update_engine_weights(load_pretrained(trained, dtype=torch.float32, device="cpu"), engine,
                                         1 << 20)
    assert written == sum(p.numel() * 4 for p in engine.model.parameters())
    after = _greedy(engine)
    assert after == _greedy(_engine(trained, False)) and after != before


def test_a_session_must_end_before_the_weights_go(tmp_path):
    engine = _engine(_ckpt(tmp_path, 0), True)
    engine.add(Request(0, [5, 9], SamplingParams(temperature=0.0, max_new_tokens=4)))
    engine.step()
    with pytest.raises(RuntimeError, match="release the session first"):
        engine.release_weights()
    with pytest.raises(RuntimeError, match="without offload_weights"):
        _engine(_ckpt(tmp_path, 1), False).release_weights()


def _argv(a: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--hf-checkpoint", str(a / "ckpt"), "--prompt-data", str(a / "data" / "train.parquet"),
            "--input-key", "messages", "--label-key", "label", "--apply-chat-template",
            "--custom-rm-path", "tests.rewards_for_tests.hash_reward", "--num-rollout", "3",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256", "--lr", "1e-2", "--device", "cpu",
            "--output-dir", str(out), "--save", str(out / "ck"), "--save-interval", "3", *extra]


def test_a_run_releases_the_weights_after_each_rollout_and_trains_the_same(tmp_path, capsys, monkeypatch):
    """Released after set-up's memory plan and after each rollout, taken back by each weight update; the
    run's metrics and final weights equal a run that keeps them (so every rollout after the first ran on
    the synced weights, not on whatever a restored arena held)."""
    a = tiny_assets(tmp_path / "assets")
    events: list[str] = []
    release, restore = Engine.release_weights, Engine.restore_weights
    monkeypatch.setattr(Engine, "release_weights", lambda self: (events.append("release"), release(self))[1])
    monkeypatch.setattr(Engine, "restore_weights", lambda self: (
        events.append("restore") if self.runner.weights_released else None, restore(self))[1])
    assert run_cli(_argv(a, tmp_path / "kept", "--offload-rollout-level", "kv_cache"), capsys)[0] == 0
    assert events == []
    assert run_cli(_argv(a, tmp_path / "freed"), capsys)[0] == 0           # the default: released
    assert events == ["release", "restore"] * 4          # set-up's memory plan, then 3 rollouts
    metrics = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
               for d in ("kept", "freed")]
    trained = [(m0, m1) for m0, m1 in zip(*metrics) if "train/loss" in m0]
    assert len(trained) == 3
    for m0, m1 in trained:
        for key in ("rollout/response_len/mean", "train/rollout_logprob_abs_diff", "train/loss", "train/grad_norm"):
            assert m0[key] == m1[key], key
    weights = []
    for d in ("kept", "freed"):
        model = load_pretrained(str(a / "ckpt"), dtype=torch.float32, device="cpu")
        assert load_model_weights(str(tmp_path / d / "ck"), model) == 3
        weights.append(model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_resumed_run_with_released_weights_syncs_once_and_continues_the_same(tmp_path, capsys, monkeypatch):
    """Resumed with the weights released: set-up's memory plan takes them back without writing them (the
    resume writes the checkpoint's weights: one full sync, not two), and the resumed rollout equals one that
    kept them."""
    import furlong.trainer.weight_sync as weight_sync
    a = tiny_assets(tmp_path / "assets")
    assert run_cli(_argv(a, tmp_path / "first"), capsys)[0] == 0
    syncs: list[str] = []

    def counted(*args, **kwargs):
        syncs.append("sync")
        return sync_weights(*args, **kwargs)
    monkeypatch.setattr(weight_sync, "sync_weights", counted)   # set-up's resume imports it when it runs
    monkeypatch.setattr(step, "sync_weights", counted)          # the weight update's
    lines = []
    for name, extra in (("kept", ("--offload-rollout-level", "kv_cache")), ("freed", ())):
        syncs.clear()
        resumed = [x if x != "3" else "4" for x in _argv(a, tmp_path / name, *extra)]
        assert run_cli([*resumed, "--load", str(tmp_path / "first" / "ck")], capsys)[0] == 0
        assert syncs == ["sync", "sync"], name        # the resume's, then rollout 4's weight update
        lines.append([json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                      if "train/loss" in x])
    assert len(lines[0]) == len(lines[1]) == 1 and lines[0][0]["step"] == 3
    for key in ("rollout/response_len/mean", "train/rollout_logprob_abs_diff", "train/loss", "train/grad_norm"):
        assert lines[0][0][key] == lines[1][0][key], key


def test_offload_rollout_level_names_its_values(tmp_path, capsys):
    a = tiny_assets(tmp_path / "assets")
    code, _, err = run_cli(_argv(a, tmp_path / "bad", "--offload-rollout-level", "kv_cache", "weights"), capsys)
    assert code == 2
    one_line(err, "--offload-rollout-level", "kv_cache and weight", "weights")
