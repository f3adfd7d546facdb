"""Actor: log-prob passes, reuse, optimizer-step splitting, weight sync, launcher (the memory
probe: test_actor_memory_probe.py).

Single-process tests run in this pytest process on a one-rank gloo group
(init_distributed always forms a group); two-rank tests spawn workers.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

from furlong.config import Config  # noqa: E402
from furlong.models.hf_io import load_pretrained  # noqa: E402
from furlong.config_map import actor_config, batching_config  # noqa: E402
from furlong.run.step import log_prob_passes, old_log_probs, ref_log_probs  # noqa: E402
from furlong.trainer.actor import Actor  # noqa: E402
from furlong.launch.distributed import WorkerError, all_reduce_max, init_distributed, launch_local  # noqa: E402
from furlong.trainer.weight_sync import _buckets, sync_weights  # noqa: E402
from furlong.types import TrainSample  # noqa: E402

VOCAB = 128


# ---------------------------------------------------------------- shared helpers (other test files import them)

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", family="qwen3", vocab_size=VOCAB,
                                 hidden=32, layers=2, heads=4, kv_heads=2, tie=False, init_std=0.05)


def tiny_config(**overrides) -> Config:
    """Config with lr 1e-3 and `overrides` set by field name in whichever group defines it."""
    cfg = Config()
    cfg.optim.lr = 1e-3
    cfg.rollout.num_rollout = 4
    groups = [getattr(cfg, f.name) for f in dataclasses.fields(cfg)]
    for key, value in overrides.items():
        owner = [g for g in groups if hasattr(g, key)]
        if len(owner) != 1:
            raise KeyError(key)
        setattr(owner[0], key, value)
    return cfg


def synthetic_samples(lengths: list[int], seed: int = 0) -> list[TrainSample]:
    """Deterministic samples with the given total token counts; prompts of 2-5 tokens;
    sample 1 (when present) masks out half of its response."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        p = 2 + i % 4 if n > 5 else 1
        r = n - p
        mask = None
        if i == 1:
            mask = torch.ones(r)
            mask[: r // 2] = 0
        out.append(TrainSample(
            token_ids=torch.randint(0, VOCAB, (n,), generator=g), num_prompt_tokens=p,
            advantages=torch.randn(r, generator=g), rollout_log_probs=-torch.rand(r, generator=g) * 5,
            loss_mask=mask))
    return out


def train_rollout(actor: Actor, cfg: Config, samples: list[TrainSample]):
    """One rollout's training as the loop runs it (run/step.py): the log-prob passes the flags
    call for, then train_step (on copies: the stages set fields of the samples)."""
    a = cfg.algo
    passes = log_prob_passes(a.use_rollout_logprobs, a.use_kl_loss, a.kl_coef, a.skip_actor_forward_only,
                             batching_config(cfg).num_optimizer_steps(len(samples)))
    samples = [dataclasses.replace(s) for s in samples]
    steps = batching_config(cfg)
    old_log_probs(samples, actor, steps, passes.old)
    ref_log_probs(samples, actor, steps, passes.ref)
    return actor.train_step(samples, steps)


def full_weights(actor: Actor) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in actor.model.named_parameters()}


def full_grads(actor: Actor) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()}


def capture_grads(actor: Actor) -> dict[str, torch.Tensor]:
    """Patch the optimizer so the gradients of the (last) step are recorded before it runs."""
    store: dict[str, torch.Tensor] = {}
    actor.optimizer.register_step_pre_hook(lambda *_: store.update(full_grads(actor)))
    return store


# ---------------------------------------------------------------- log-probs

def test_compute_log_probs_matches_unpacked_forward(tiny_ckpt):
    ctx = init_distributed("cpu")
    cfg = tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="30", rollout_temperature=0.7)
    actor = Actor(load_pretrained(tiny_ckpt), actor_config(cfg), ctx)
    samples = synthetic_samples([17, 9, 25, 6, 12])
    got = actor.compute_log_probs(samples, batching_config(cfg), "old")
    # every layer resharded afterwards, though they stay gathered across a train step's micro-batches
    # (fsdp.py): checkpointing and weight sync expect the fp32 DTensor shards
    assert all(hasattr(p, "full_tensor") and p.dtype == torch.float32 for p in actor.model.parameters())
    plain = load_pretrained(tiny_ckpt)
    with torch.no_grad():
        for s, lp in zip(samples, got):
            logits = plain(s.token_ids[None])[0].float() / 0.7
            want = F.log_softmax(logits, -1)[:-1].gather(1, s.token_ids[1:, None])[:, 0][s.num_prompt_tokens - 1:]
            assert lp.shape == (s.num_response_tokens,)
            torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)


def test_ref_log_probs_need_kl_loss(tiny_ckpt):
    actor = Actor(load_pretrained(tiny_ckpt), actor_config(tiny_config()), init_distributed("cpu"))
    with pytest.raises(ValueError, match="ref"):
        actor.compute_log_probs(synthetic_samples([8]), batching_config(tiny_config()), "ref")


# ---------------------------------------------------------------- log-prob reuse

def test_reuse_equals_two_pass(tiny_ckpt):
    """old_log_probs None (reuse) gives the same loss, gradients and update as a separate pass."""
    ctx = init_distributed("cpu")
    samples = synthetic_samples([14, 9, 20, 7])
    results = []
    for explicit in (False, True):
        cfg = tiny_config(micro_batch_size=2, eps_clip_high=0.28)
        actor = Actor(load_pretrained(tiny_ckpt), actor_config(cfg), ctx)
        assert log_prob_passes(False, False, 0.0, None, batching_config(cfg).num_optimizer_steps(len(samples))).old == "training"
        batch = samples
        if explicit:
            old = actor.compute_log_probs(samples, batching_config(cfg), "old")
            batch = [dataclasses.replace(s, old_log_probs=o) for s, o in zip(samples, old)]
        grads = capture_grads(actor)
        m = actor.train_step(batch, batching_config(cfg))
        results.append((m, grads, full_weights(actor)))
    (m0, g0, w0), (m1, g1, w1) = results
    assert m0.loss == pytest.approx(m1.loss, rel=1e-6, abs=1e-8)
    assert m0.ppo_kl == m1.ppo_kl == 0.0
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(w0[n], w1[n], rtol=1e-6, atol=1e-8)


def test_gradient_checkpointing_same_gradients(tiny_ckpt):
    ctx = init_distributed("cpu")
    samples = synthetic_samples([14, 9, 20])
    grads = []
    for ckpt_on in (False, True):
        cfg = tiny_config(gradient_checkpointing=ckpt_on, micro_batch_size=2)
        actor = Actor(load_pretrained(tiny_ckpt), actor_config(cfg), ctx)
        assert actor.model.gradient_checkpointing is ckpt_on
        grads.append(capture_grads(actor))
        actor.train_step(samples, batching_config(cfg))
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-8, msg=n)


# ---------------------------------------------------------------- optimizer steps

def test_several_optimizer_steps_per_rollout(tiny_ckpt):
    """--global-batch-size 2 on 4 samples: two updates; old log-probs are computed once,
    before the first update (so the second step sees ppo_kl != 0)."""
    ctx = init_distributed("cpu")
    cfg = tiny_config(global_batch_size=2, lr=1e-2)
    actor = Actor(load_pretrained(tiny_ckpt), actor_config(cfg), ctx)
    samples = synthetic_samples([10, 12, 9, 11])
    before = full_weights(actor)
    with pytest.raises(ValueError, match="old log-probs"):   # train_step only trains: the passes run before it
        actor.train_step(samples, batching_config(cfg))
    m = train_rollout(actor, cfg, samples)
    assert m.num_steps == 2 and m.num_micro_batches == 4 and m.num_tokens == 42
    assert m.ppo_kl != 0.0 and m.num_skipped_steps == 0
    assert any(not torch.equal(before[n], w) for n, w in full_weights(actor).items())
    assert actor.scheduler.last_epoch == 2
    with pytest.raises(ValueError, match="--global-batch-size"):
        train_rollout(actor, cfg, synthetic_samples([10, 12, 9]))


def test_sft_loss_trains(tiny_ckpt):
    """Actor(loss='sft') lowers the cross-entropy of the data it trains on."""
    ctx = init_distributed("cpu")
    cfg = tiny_config(lr=1e-2, micro_batch_size=4)
    actor, steps = Actor(load_pretrained(tiny_ckpt), actor_config(cfg), ctx, loss="sft"), batching_config(cfg)
    samples = synthetic_samples([12, 10, 14])
    losses = [actor.train_step(samples, steps).loss for _ in range(4)]
    assert losses[-1] < losses[0]
    nll = -sum(float(lp.mean()) for lp in actor.compute_log_probs(samples, steps)) / 3
    assert nll == pytest.approx(losses[0], rel=0.5)  # same scale: mean token NLL


# ---------------------------------------------------------------- distributed helpers

def _failing_worker(bad_rank: int) -> None:
    ctx = init_distributed("cpu")
    assert all_reduce_max([ctx.rank, -ctx.rank]) == [1.0, 0.0]
    if ctx.rank == bad_rank:
        raise ValueError("--lr: worker says no\nsecond line")
    torch.distributed.barrier()  # the healthy rank blocks here until it is terminated


def test_launch_local_reports_worker_error():
    with pytest.raises(WorkerError, match=r"^rank 1: ValueError: --lr: worker says no$"):
        launch_local(_failing_worker, 2, 1)


# ---------------------------------------------------------------- weight sync

def _sync_worker(ckpt: str, out: str) -> None:
    ctx = init_distributed("cpu")
    actor = Actor(load_pretrained(ckpt), actor_config(tiny_config(lr=1e-2)), ctx)
    actor.train_step(synthetic_samples([9, 14, 6]), batching_config(tiny_config()))   # weights now differ
    engines = {torch.float32: load_pretrained(ckpt), torch.bfloat16: load_pretrained(ckpt, dtype=torch.bfloat16)}
    written = {dt: sync_weights(actor.model, eng, bucket_bytes=4096) for dt, eng in engines.items()}
    gathered = full_weights(actor)
    if ctx.rank == 0:
        torch.save({"gathered": gathered, "written": written,
                    "engines": {dt: dict(e.named_parameters()) for dt, e in engines.items()}}, out)


def test_sync_weights_two_ranks(tiny_ckpt, tmp_path):
    out = tmp_path / "sync.pt"
    launch_local(_sync_worker, 2, str(tiny_ckpt), str(out))
    r = torch.load(out, weights_only=False)
    initial = dict(load_pretrained(tiny_ckpt).named_parameters())
    assert any(not torch.equal(initial[n], w) for n, w in r["gathered"].items())
    for dt, params in r["engines"].items():
        assert set(params) == set(r["gathered"])
        for n, w in r["gathered"].items():
            assert params[n].dtype == dt
            assert torch.equal(params[n], w.to(dt)), n
        assert r["written"][dt] == sum(w.numel() * dt.itemsize for w in r["gathered"].values())


def test_weight_sync_buckets_and_mismatch(tiny_ckpt):
    params = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([100, 300, 2000, 50, 50])]
    buckets = _buckets(params, torch.float32, bucket_bytes=1600)
    assert [[n for n, _ in b] for b in buckets] == [["p0", "p1"], ["p2"], ["p3", "p4"]]
    actor = Actor(load_pretrained(tiny_ckpt), actor_config(tiny_config()), init_distributed("cpu"))
    other = load_pretrained(write_tiny_checkpoint(Path(tiny_ckpt).parent / "tied", vocab_size=VOCAB, hidden=32,
                                                  tie=True, with_tokenizer=False))
    with pytest.raises(ValueError, match="weight sync"):
        sync_weights(actor.model, other, bucket_bytes=1 << 20)
