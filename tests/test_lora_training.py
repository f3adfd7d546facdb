"""LoRA in the trainer: frozen base without masters or optimizer state, the reference = adapters off,
merged weight sync, adapter-only checkpoints with exact resume, export, 2 gloo ranks = 1 process,
the flags' checks, and a LoRA GRPO run that learns (CLI, CPU).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_actor import full_weights, synthetic_samples, tiny_ckpt, tiny_config, train_rollout  # noqa: E402,F401 (fixture)
from test_e2e import _resume_flags, assets, read_metrics  # noqa: E402,F401 (assets: fixture)

from furlong.cli import main  # noqa: E402
from furlong.config import Config  # noqa: E402
from furlong.config_checks import validate  # noqa: E402
from furlong.lora_flags import check_checkpoint_model  # noqa: E402
from furlong.models.hf_config import ModelArgs  # noqa: E402
from furlong.models.hf_io import load_pretrained  # noqa: E402
from furlong.models.lora import adapter_state_dict, apply_lora, is_adapter_param, lora_modules, merged_weight  # noqa: E402
from furlong.models.lora_names import resolve_targets  # noqa: E402
from furlong.config_map import actor_config, batching_config  # noqa: E402
from furlong.trainer.actor import Actor  # noqa: E402
from furlong.checkpoint.store import load_checkpoint, load_model_weights, save_checkpoint  # noqa: E402
from furlong.checkpoint.verify import choose_checkpoint  # noqa: E402
from furlong.launch.distributed import init_distributed, launch_local  # noqa: E402
from furlong.trainer.weight_sync import sync_weights  # noqa: E402

LORA = dict(lora_rank=4, lora_alpha=16.0)
LENGTHS = [14, 9, 20, 7, 11]


def _actor(ckpt, **overrides) -> tuple[Actor, Config]:
    cfg = tiny_config(lr=1e-2, **{**LORA, **overrides})
    dtype = torch.bfloat16 if overrides.get("dtype") == "bf16" else torch.float32
    return Actor(load_pretrained(ckpt, dtype=dtype), actor_config(cfg), init_distributed("cpu")), cfg


def _unsharded(ckpt, actor: Actor) -> torch.nn.Module:
    """A plain adapted model holding the actor's current adapters (for reference computations)."""
    model = load_pretrained(ckpt)
    apply_lora(model, actor.cfg.lora, resolve_targets(model, actor.cfg.lora.target_modules))
    with torch.no_grad():
        for n, p in adapter_state_dict(model).items():
            p.copy_(full_weights(actor)[n])
    return model


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_base_frozen_without_masters_or_optimizer_state(tiny_ckpt, dtype):
    actor, cfg = _actor(tiny_ckpt, dtype=dtype, use_kl_loss=True, kl_loss_coef=0.1)
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    before = full_weights(actor)
    for n, p in actor.model.named_parameters():
        # the base stays in the compute dtype (no fp32 copy); adapters are fp32 masters
        assert p.dtype == (torch.float32 if is_adapter_param(n) else compute), n
        assert p.requires_grad == is_adapter_param(n), n
    assert actor.ref_model is None   # the reference is the same model with adapters off
    optimized = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in actor.model.named_parameters() if is_adapter_param(n)}
    assert set(map(id, actor.optimizer.state)) <= optimized
    metrics = [train_rollout(actor, cfg, synthetic_samples(LENGTHS)) for _ in range(2)]
    assert metrics[0].kl_loss == 0 and metrics[1].kl_loss > 0   # B starts at 0: step 1 is the base
    after = full_weights(actor)
    for n, w in before.items():
        if is_adapter_param(n):
            assert not torch.equal(after[n], w), n   # A moves from step 2 on (its gradient is 0 while B is)
        else:
            assert torch.equal(after[n], w), n
    assert all(after[n].abs().max() > 0 for n in after if n.endswith("lora_B"))


def test_reference_log_probs_are_the_base_models(tiny_ckpt):
    actor, cfg = _actor(tiny_ckpt, use_kl_loss=True, kl_loss_coef=0.1)
    samples = synthetic_samples(LENGTHS)
    for _ in range(2):
        train_rollout(actor, cfg, samples)
    plain = Actor(load_pretrained(tiny_ckpt), actor_config(tiny_config()), init_distributed("cpu"))
    base = plain.compute_log_probs(samples, batching_config(cfg), "old")
    ref = actor.compute_log_probs(samples, batching_config(cfg), "ref")
    old = actor.compute_log_probs(samples, batching_config(cfg), "old")
    for r, b, o in zip(ref, base, old):
        torch.testing.assert_close(r, b, rtol=1e-6, atol=1e-6)
        assert (o - b).abs().max() > 1e-4   # the adapters were on for "old" again
    with torch.no_grad():   # and "old" is base + adapters
        model = _unsharded(tiny_ckpt, actor)
        s = samples[0]
        logits = model(s.token_ids[None])[0].float()
        want = torch.log_softmax(logits, -1)[:-1].gather(1, s.token_ids[1:, None])[:, 0][s.num_prompt_tokens - 1:]
        torch.testing.assert_close(old[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("engine_dtype", [torch.float32, torch.bfloat16])
def test_weight_sync_sends_merged_weights(tiny_ckpt, engine_dtype):
    actor, cfg = _actor(tiny_ckpt)
    train_rollout(actor, cfg, synthetic_samples(LENGTHS))
    engine = load_pretrained(tiny_ckpt, dtype=engine_dtype)
    sync_weights(actor.model, engine, bucket_bytes=4096)
    full = full_weights(actor)
    mods = lora_modules(actor.model)
    got = dict(engine.named_parameters())
    assert set(got) == {n for n in full if not is_adapter_param(n)}
    for n, w in got.items():
        owner = n.rpartition(".")[0]
        want = full[n].to(engine_dtype)
        if owner in mods and n.endswith(".weight"):
            want = merged_weight(want, full[owner + ".lora_A"], full[owner + ".lora_B"], mods[owner].scaling)
            assert not torch.equal(want, full[n].to(engine_dtype)), n
        assert torch.equal(w, want), n
    if engine_dtype == torch.float32:   # the engine's model is base + adapters
        ids = synthetic_samples(LENGTHS)[2].token_ids[None]
        with torch.no_grad():
            torch.testing.assert_close(engine(ids), _unsharded(tiny_ckpt, actor)(ids), rtol=1e-5, atol=1e-5)


def test_checkpoint_holds_adapters_only_and_resume_is_exact(tiny_ckpt, tmp_path):
    samples = synthetic_samples(LENGTHS)
    a, cfg = _actor(tiny_ckpt, lora_dropout=0.1)
    train_rollout(a, cfg, samples)
    save_checkpoint(tmp_path / "ck", a, 0, source=str(tiny_ckpt), lora=a.cfg.lora)
    import torch.distributed.checkpoint as dcp
    meta = dcp.FileSystemReader(str(tmp_path / "ck" / "iter_0000001")).read_metadata()
    keys = list(meta.state_dict_metadata)
    assert keys and all("lora_" in k for k in keys if k.startswith(("model.", "optim.state."))), keys
    assert sum(k.startswith("model.") for k in keys) == len(adapter_state_dict(a.model))
    # a fresh actor (other seed: other initial adapters) resumes exactly, dropout's RNG included
    b, _ = _actor(tiny_ckpt, lora_dropout=0.1, seed=99)
    assert load_checkpoint(tmp_path / "ck", b).rollout_id == 0
    rng = torch.get_rng_state()
    ma = train_rollout(a, cfg, samples)
    torch.set_rng_state(rng)
    mb = train_rollout(b, cfg, samples)
    assert (ma.loss, ma.grad_norm) == (mb.loss, mb.grad_norm)
    wa, wb = full_weights(a), full_weights(b)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    choice = choose_checkpoint(tmp_path / "ck", None, None)
    args = ModelArgs.from_dir(tiny_ckpt)
    check_checkpoint_model(choice, args, tiny_config(**LORA, lora_dropout=0.1, seed=5), training=True)
    for flags, needle in [({}, "--lora-rank: .* holds LoRA adapters; resume it with --lora-rank 4"),
                          ({**LORA, "lora_rank": 8}, "--lora-rank: .* trained with --lora-rank 4, not 8"),
                          ({**LORA, "lora_dropout": 0.1, "target_modules": "q_proj"},
                           "--target-modules: .* trained with --target-modules all-linear, not q_proj")]:
        with pytest.raises(ValueError, match=needle):
            check_checkpoint_model(choice, args, tiny_config(**flags), training=True)


def test_export_and_eval_load_of_a_lora_checkpoint(tiny_ckpt, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    actor, cfg = _actor(tiny_ckpt)
    train_rollout(actor, cfg, synthetic_samples(LENGTHS))
    save_checkpoint(tmp_path / "ck", actor, 0, source=str(tiny_ckpt), lora=actor.cfg.lora)
    ids = synthetic_samples(LENGTHS)[0].token_ids[None]
    with torch.no_grad():
        want = _unsharded(tiny_ckpt, actor)(ids)
    assert main(["export", "--load", str(tmp_path / "ck"), "--output", str(tmp_path / "adapter")]) == 0
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tiny_ckpt) and cfg["r"] == 4 and cfg["lora_alpha"] == 16.0
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, attn_implementation="eager", dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    assert main(["export", "--load", str(tmp_path / "ck"), "--output", str(tmp_path / "merged"), "--merged"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager", dtype=torch.float32)
    engine = load_pretrained(tiny_ckpt)
    assert load_model_weights(tmp_path / "ck", engine) == 1    # furlong eval --load
    with torch.no_grad():
        for got in (pm(input_ids=ids).logits, merged(ids).logits, engine(ids)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # over the peft folder: refused without --overwrite; with it the adapter's files go, other files stay
    (tmp_path / "adapter" / "notes.txt").write_text("mine")
    assert main(["export", "--load", str(tmp_path / "ck"), "--output", str(tmp_path / "adapter"), "--merged"]) == 2
    assert main(["export", "--load", str(tmp_path / "ck"), "--output", str(tmp_path / "adapter"), "--merged",
                 "--overwrite"]) == 0
    left = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert "notes.txt" in left and "model.safetensors" in left and not any("adapter" in n for n in left), left


SCENARIO = dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", clip_grad=0.0,
                global_batch_size=5, lora_dropout=0.0)


def _run(ckpt: str, distributed: bool) -> dict:
    if distributed:
        cfg = tiny_config(lr=1e-2, use_dynamic_batch_size=True, max_tokens_per_gpu="24", **LORA, **SCENARIO)
    else:
        cfg = tiny_config(lr=1e-2, micro_batch_size=1, fsdp_reshard_after_forward=True, **LORA, **SCENARIO)
    actor = Actor(load_pretrained(ckpt), actor_config(cfg), init_distributed("cpu"))
    m = train_rollout(actor, cfg, synthetic_samples([40, 20, 12, 10, 9, 8, 7, 6, 5, 4]))
    return {"weights": full_weights(actor), "metrics": m}


def _worker(ckpt: str, out: str) -> None:
    r = _run(ckpt, distributed=True)
    if torch.distributed.get_rank() == 0:
        torch.save(r, out)


def test_two_ranks_match_one_process(tiny_ckpt, tmp_path):
    """FSDP2 over a model with frozen parameters: 2 gloo ranks (dynamic batches, KL against the
    adapters-off reference, two optimizer steps) = 1 process, adapters after the steps included."""
    launch_local(_worker, 2, str(tiny_ckpt), str(tmp_path / "r.pt"))
    got = torch.load(tmp_path / "r.pt", weights_only=False)
    ref = _run(str(tiny_ckpt), distributed=False)
    for field in ("loss", "pg_loss", "kl_loss", "grad_norm", "entropy"):
        assert getattr(got["metrics"], field) == pytest.approx(getattr(ref["metrics"], field), rel=1e-5, abs=1e-7)
    assert got["metrics"].kl_loss > 0
    for n, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][n], w, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("flag,value,needle", [("lora_rank", -1, "--lora-rank: must be >= 0"),
                                                ("lora_alpha", 0.0, "--lora-alpha: must be > 0"),
                                                ("lora_dropout", 1.0, r"--lora-dropout: must be in \[0, 1\)"),
                                                ("target_modules", "q_proj,,v_proj", "--target-modules: expected")])
def test_bad_lora_flags_name_the_flag(flag, value, needle):
    cfg = tiny_config(**{**LORA, flag: value})
    with pytest.raises(ValueError, match=needle):
        validate(cfg, command="check")
    validate(tiny_config(**LORA), command="check")


def test_unknown_target_module_is_one_line(assets, tmp_path, capsys):
    argv = _resume_flags(assets, tmp_path / "run", 1, "--lora-rank", "4", "--target-modules", "qkv_proj")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("furlong: error: --target-modules: 'qkv_proj' matches no") and len(err.splitlines()) == 1


def _lora_flags(a: Path, out: Path, num_rollout: int, *extra: str) -> list[str]:
    return _resume_flags(a, out, num_rollout, "--lora-rank", "8", "--lora-alpha", "16", *extra)


@pytest.mark.slow
def test_lora_grpo_learns(assets, tmp_path, capsys):
    """The learning check of test_e2e.py's estimators, with LoRA (rank 8, all-linear) on the frozen tiny
    model: ten rollouts must raise the share of 'e' in the responses several-fold (measured: about 0.015 in
    the first two, 0.2-0.25 from the seventh on; slow: about 5 min on a loaded 2-core CPU)."""
    out = tmp_path / "run"
    argv = _lora_flags(assets, out, 10, "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
                       "--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048")
    argv[argv.index("--custom-rm-path") + 1] = "tests.rewards_for_tests.letter_reward"
    argv[argv.index("--lr") + 1] = "3e-2"
    argv[argv.index("--rollout-max-response-len") + 1] = "8"
    assert main(argv) == 0, capsys.readouterr().err
    rewards = [r["rollout/raw_reward"] for r in read_metrics(out)]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    assert last > 0.15 and last > 4 * first, rewards


def test_lora_resume_continues_exactly(assets, tmp_path, capsys):
    from safetensors.torch import load_file
    ck = tmp_path / "ck"
    extra = ("--use-kl-loss", "--kl-loss-coef", "0.1", "--lora-dropout", "0.1")
    assert main(_lora_flags(assets, tmp_path / "fresh", 3, "--save", str(tmp_path / "fresh_ck"), *extra)) == 0
    assert main(_lora_flags(assets, tmp_path / "first", 2, "--save", str(ck), "--save-interval", "1", *extra)) == 0
    assert main(_lora_flags(assets, tmp_path / "resumed", 3, "--load", str(ck), "--save", str(tmp_path / "resumed_ck"),
                            *extra)) == 0
    fresh, resumed = read_metrics(tmp_path / "fresh"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [2]
    for key in ("rollout/raw_reward", "train/num_tokens", "rollout/rollout_log_probs", "train/loss",
                "train/grad_norm", "train/kl_loss"):
        assert fresh[2][key] == resumed[0][key], key
    assert fresh[2]["train/kl_loss"] > 0
    for run in ("fresh", "resumed"):
        assert main(["export", "--load", str(tmp_path / f"{run}_ck"), "--output", str(tmp_path / f"{run}_a")]) == 0
    wa = load_file(str(tmp_path / "fresh_a" / "adapter_model.safetensors"))
    wb = load_file(str(tmp_path / "resumed_a" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # a LoRA checkpoint resumed without --lora-rank: one line naming the flag
    capsys.readouterr()
    assert main(_resume_flags(assets, tmp_path / "full", 3, "--load", str(ck))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("furlong: error: --lora-rank:") and len(err.splitlines()) == 1, err


def test_spec_carries_the_flags():
    spec = actor_config(tiny_config(**LORA, target_modules="q_proj, v_proj", seed=7)).lora
    assert dataclasses.astuple(spec) == (4, 16.0, 0.0, ("q_proj", "v_proj"), 7)
    assert actor_config(tiny_config()).lora is None


def test_mfu_counts_weight_gradients_only_for_trained_weights(tiny_ckpt):
    """MFU's FLOPs per token: 6 x params for full-parameter training; under LoRA 4 x the base's params
    plus 6 x the adapters' (no weight gradients for the frozen base), not the 6N that overstated it."""
    from furlong.trainer.mfu import model_flops_per_token, train_flops_per_token
    base = sum(p.numel() for p in load_pretrained(tiny_ckpt).parameters())
    full = Actor(load_pretrained(tiny_ckpt), actor_config(tiny_config()), init_distributed("cpu"))
    assert model_flops_per_token(full.model) == 6 * base
    lora, _ = _actor(tiny_ckpt)
    adapters = sum(p.numel() for n, p in lora.model.named_parameters() if is_adapter_param(n))
    assert 0 < adapters < base
    assert model_flops_per_token(lora.model) == 4 * base + 6 * adapters == train_flops_per_token(base + adapters,
                                                                                                  adapters)
