"""The memory planner: budget and recompute from measured probes (pure arithmetic, CPU)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from furlong.trainer.memory_plan import (MemoryBudget, MemoryPlanError, ModeProbe, largest_fit, memory_flags_off,
                                         out_of_memory_line, plan_memory)

GiB = 2**30
sys.path.insert(0, str(Path(__file__).resolve().parent))   # test_actor, tiny_checkpoints


def probes(intercept_s: float = 0.05, fixed_gib: float = 40.0):
    """A 4B-like trainer: 2.9 MiB/token without recompute, 0.9 with; recompute 1/3 slower per token."""
    no = ModeProbe(False, (4096, 8192), (int(fixed_gib * GiB + 4096 * 2.9 * 2**20), int(fixed_gib * GiB + 8192 * 2.9 * 2**20)),
                   (intercept_s + 4096e-5, intercept_s + 8192e-5))
    re = ModeProbe(True, (4096, 8192), (int(fixed_gib * GiB + 4096 * 0.9 * 2**20), int(fixed_gib * GiB + 8192 * 0.9 * 2**20)),
                   (intercept_s + 4096 * 1.33e-5, intercept_s + 8192 * 1.33e-5))
    return {False: no, True: re}


BUDGET = MemoryBudget(total_bytes=140 * GiB, reserved_bytes=8 * GiB, pending_bytes=20 * GiB)


def _tiny_ckpt(tmp_path: Path) -> Path:
    """The tiny checkpoint these tests' real (CPU) actors load."""
    from tiny_checkpoints import write_tiny_checkpoint
    return write_tiny_checkpoint(tmp_path / "ckpt", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1)


def _actor(ckpt: Path, **overrides):
    """A real (CPU, FSDP2) actor on `ckpt`: test_actor's tiny_config with dynamic batching and `overrides`."""
    from test_actor import tiny_config
    from furlong.config_map import actor_config
    from furlong.launch.distributed import init_distributed
    from furlong.models.hf_io import load_pretrained
    from furlong.trainer.actor import Actor
    cfg = tiny_config(use_dynamic_batch_size=True, **overrides)
    return Actor(load_pretrained(ckpt), actor_config(cfg), init_distributed("cpu"))


def test_affine_model_and_largest_fit():
    p = probes()[False]
    assert p.per_token_bytes() == pytest.approx(2.9 * 2**20)
    assert p.peak(16384, 0) == pytest.approx(40 * GiB + 16384 * 2.9 * 2**20)
    b = largest_fit(p, BUDGET)
    assert b % 1024 == 0 and p.peak(b, BUDGET.pending_bytes) <= BUDGET.usable_bytes
    assert p.peak(b + 1024, BUDGET.pending_bytes) > BUDGET.usable_bytes


def test_budget_that_fits_is_kept_silently():
    plan = plan_memory(probes(), BUDGET, 8192, False, min_tokens=1200)
    assert (plan.max_tokens_per_gpu, plan.gradient_checkpointing, plan.note) == (8192, False, None)


def test_budget_that_needs_recompute_turns_it_on():
    # 32768 tokens: 40 + 20 + 92.8 GiB without recompute > 111 usable; 40 + 20 + 28.8 with.
    plan = plan_memory(probes(intercept_s=0.3), BUDGET, 32768, False, min_tokens=1200)
    assert plan.gradient_checkpointing and plan.max_tokens_per_gpu == 32768
    assert plan.note.startswith("memory: turned --gradient-checkpointing on: 32768 tokens")
    # the rates it compared: (0.3 s + 32768 x 1.33e-5 s) / 32768 tokens, and the lowered budget's without recompute
    assert plan.note.endswith("predicted 44.5k tok/s against 36.7k tok/s for 17408 tokens with recompute off)")


def test_lowering_wins_when_micro_batches_are_cheap_to_split():
    # No fixed cost per micro-batch: a smaller budget costs nothing, recompute costs a third more.
    plan = plan_memory(probes(intercept_s=0.0), BUDGET, 32768, False, min_tokens=1200)
    assert not plan.gradient_checkpointing and plan.max_tokens_per_gpu < 32768
    assert "lowered --max-tokens-per-gpu to" in plan.note and "turned" not in plan.note


def test_requested_recompute_stays_on_and_budget_is_lowered():
    big = MemoryBudget(total_bytes=80 * GiB, reserved_bytes=8 * GiB, pending_bytes=0)
    plan = plan_memory(probes(), big, 65536, True, min_tokens=1200)
    assert plan.gradient_checkpointing and plan.max_tokens_per_gpu < 65536
    assert "lowered --max-tokens-per-gpu" in plan.note


def test_auto_picks_the_faster_mode():
    slow_split = plan_memory(probes(intercept_s=0.5), BUDGET, None, False, min_tokens=1200)
    assert slow_split.gradient_checkpointing   # recompute's much larger budget amortises the fixed cost
    cheap_split = plan_memory(probes(intercept_s=0.0), BUDGET, None, False, min_tokens=1200)
    assert not cheap_split.gradient_checkpointing
    assert cheap_split.note.startswith("--max-tokens-per-gpu auto:")
    forced = plan_memory(probes(intercept_s=0.0), BUDGET, None, True, min_tokens=1200)
    assert forced.gradient_checkpointing


def test_longest_sample_bounds_the_budget_and_nothing_fitting_names_flags():
    tiny = MemoryBudget(total_bytes=80 * GiB, reserved_bytes=8 * GiB, pending_bytes=0)
    with pytest.raises(MemoryPlanError, match=r"^--max-tokens-per-gpu: .*--fsdp-reshard-after-forward.*--lora-rank.*"
                                              r"--fsdp-cpu-offload.*--rollout-max-response-len$"):
        plan_memory(probes(fixed_gib=70), tiny, 32768, False, min_tokens=4096)
    # fits only below the longest sample: refused too, never a budget a sample cannot fit in
    with pytest.raises(MemoryPlanError):
        plan_memory(probes(fixed_gib=60), tiny, None, False, min_tokens=9000)


# ------------------------------------------------------------------ wiring: the probe's plan, the OOM line

def test_trainer_plan_with_injected_probes_on_cpu(tmp_path):
    """plan_trainer_memory on a real (CPU) actor: pending AdamW bytes come from its trainable parameters,
    and a budget that needs recompute turns it on."""
    from furlong.trainer.memory_probe import plan_trainer_memory
    actor = _actor(_tiny_ckpt(tmp_path))
    assert plan_trainer_memory(actor, 4096, False, min_tokens=100).note is None   # CPU, nothing measured
    plan = plan_trainer_memory(actor, 32768, False, min_tokens=1200,
                               measure=lambda modes, sizes: probes(intercept_s=0.5),
                               total_bytes=140 * GiB, reserved_bytes=8 * GiB)
    assert plan.gradient_checkpointing and plan.max_tokens_per_gpu == 32768
    assert "turned --gradient-checkpointing on" in plan.note and not plan.reshard_after_forward
    assert not actor.shard.reshard_after_forward


def test_when_nothing_fits_with_gathered_weights_the_plan_reshards_after_forward(tmp_path):
    """Qwen3-8B full-parameter with --optimizer-cpu-offload on an 80 GB card: both modes' probes run out of
    memory while each layer's weights stay gathered; the plan turns --fsdp-reshard-after-forward on, measures
    again, and says so. On a real (CPU, FSDP2) actor: its layers then reshard after forward (their
    parameters are sharded again right after a forward with grad) and a train step runs; when nothing fits
    even then, the one line says it was measured with the flag and does not suggest it."""
    import torch
    from torch.distributed.tensor import DTensor
    from test_actor import full_weights, synthetic_samples, tiny_config, train_rollout

    from furlong.trainer.memory_probe import _probe_batch, plan_trainer_memory
    ckpt = _tiny_ckpt(tmp_path)
    cfg = tiny_config(use_dynamic_batch_size=True, max_tokens_per_gpu="32")   # train_rollout's too
    actor = _actor(ckpt, max_tokens_per_gpu="32")
    measured = []

    def measure(modes, sizes):
        measured.append((modes, actor.shard.reshard_after_forward))
        return {m: _oom(m, 76.3) if not actor.shard.reshard_after_forward else probes()[m] for m in modes}

    def gathered_after_forward() -> bool:
        mb, _ = _probe_batch(16, 128, torch.device("cpu"))
        actor.model.forward_packed(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
        gathered = not isinstance(actor.model.layers[0].mlp.up_proj.weight, DTensor)
        actor.model.zero_grad(set_to_none=True)
        for m in actor.model.modules():
            if hasattr(m, "reshard"):
                m.reshard()
        return gathered

    assert gathered_after_forward()                           # FSDP's default here: kept across micro-batches
    plan = plan_trainer_memory(actor, 32768, False, min_tokens=1200, measure=measure, total_bytes=140 * GiB,
                               reserved_bytes=8 * GiB)
    assert measured == [((False,), False), ((True,), False), ((False,), True), ((True,), True)]
    # measured again, the usual plan (here the budget lowered, no recompute), after the reshard's clause
    assert plan.reshard_after_forward and plan.max_tokens_per_gpu < 32768 and not plan.gradient_checkpointing
    assert plan.note.startswith("memory: turned --fsdp-reshard-after-forward on (no micro-batch budget fit with "
                                "each layer's weights kept gathered across micro-batches); lowered "
                                f"--max-tokens-per-gpu to {plan.max_tokens_per_gpu}: 32768 tokens per micro-batch")
    assert actor.shard.reshard_after_forward and not gathered_after_forward()
    before = full_weights(actor)
    assert math.isfinite(train_rollout(actor, cfg, synthetic_samples([12, 9, 15, 7])).loss)
    assert any(not torch.equal(before[n], w) for n, w in full_weights(actor).items())

    again = _actor(ckpt, max_tokens_per_gpu="32")
    with pytest.raises(MemoryPlanError) as e:
        plan_trainer_memory(again, 32768, False, min_tokens=1200, total_bytes=140 * GiB,
                            measure=lambda modes, sizes: {m: _oom(m, 76.3) for m in modes})
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith("(measured again with --fsdp-reshard-after-forward turned on and with "
                                             "1024- and 2048-token probes)")
    assert "add --lora-rank or --fsdp-cpu-offload, or use more GPUs" in msg and "reshard-after-forward (frees" not in msg
    # with the engine's weights resident (reserved), releasing them is named too
    with pytest.raises(MemoryPlanError, match=r"add --offload-rollout-level kv_cache weight \(frees the engine's "
                                              r"weights while the trainer runs\), --lora-rank or --fsdp-cpu-offload"):
        plan_trainer_memory(_actor(ckpt, max_tokens_per_gpu="32"), 32768, False,
                            min_tokens=1200, total_bytes=140 * GiB, reserved_bytes=8 * GiB,
                            measure=lambda modes, sizes: {m: _oom(m, 76.3) for m in modes})


def test_the_margin_is_not_taken_of_the_weights_held_before_the_probes():
    """15% of an 80 GB card is 12 GiB; of the 50 GiB beside 30 GiB of fp32 weights (8B on an H100 with the
    optimizer's moments offloaded), 7.5: the room the 8B step needs. Without static memory: as before."""
    assert MemoryBudget(80 * GiB, 0, 0).usable_bytes == pytest.approx(68 * GiB)
    assert MemoryBudget(80 * GiB, 2 * GiB, 0).usable_bytes == pytest.approx(66 * GiB)
    assert MemoryBudget(80 * GiB, 2 * GiB, 0, static_bytes=30 * GiB).usable_bytes == pytest.approx(70.5 * GiB)


def test_the_plan_takes_the_weights_held_before_its_probes_as_static(tmp_path, monkeypatch):
    """On CUDA the plan reads the device's memory and what is allocated before its probes (stood in for
    here): 30 of 80 GiB held leaves 72.5 GiB usable, where 68 would refuse a 69 GiB fixed peak (recompute,
    ~0.9 MiB a token: 3072 tokens fit)."""
    import types

    import torch

    from furlong.trainer.memory_probe import plan_trainer_memory
    ckpt = _tiny_ckpt(tmp_path)
    actor = _actor(ckpt)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 30 * GiB)
    plan = plan_trainer_memory(actor, 32768, False, min_tokens=1200, measure=lambda modes, sizes: {
        m: probes(fixed_gib=69)[m] for m in modes})
    assert plan.gradient_checkpointing and plan.max_tokens_per_gpu == 3072 and not plan.reshard_after_forward
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 0)      # nothing held: the old margin
    again = _actor(ckpt)
    with pytest.raises(MemoryPlanError):
        plan_trainer_memory(again, 32768, False, min_tokens=1200, measure=lambda modes, sizes: {
            m: probes(fixed_gib=69)[m] for m in modes})


def test_when_nothing_fits_with_kept_logits_the_plan_recomputes_them_before_resharding(tmp_path):
    """The LM head's logits kept for backward (a tenth of the GPU) are the first thing the plan gives up,
    from the probes it already has (they ran without them); the actor then keeps none, and nothing is
    resharded. When even that does not fit, resharding follows with no logits kept."""
    from furlong.trainer.memory_probe import plan_trainer_memory
    ckpt = _tiny_ckpt(tmp_path)
    actor = _actor(ckpt)
    actor.keep_logits_bytes = 20 * GiB
    measured = []

    def measure(modes, sizes):
        measured.append(modes)
        return {m: probes(fixed_gib=60)[m] for m in modes}

    # 60 GiB fixed + 20 kept > 68 usable at any budget; without them recompute fits ~13k tokens
    plan = plan_trainer_memory(actor, 32768, False, min_tokens=1200, measure=measure, total_bytes=80 * GiB)
    assert measured == [(False,), (True,)]                    # probed once, planned twice
    assert actor.keep_logits_bytes == 0 and not plan.reshard_after_forward and not actor.shard.reshard_after_forward
    assert plan.gradient_checkpointing and 1200 <= plan.max_tokens_per_gpu < 32768
    assert plan.note.startswith("memory: the LM head's logits recomputed in backward, not kept (no micro-batch "
                                "budget fit with them kept); ")

    again = _actor(ckpt)
    again.keep_logits_bytes = 20 * GiB
    measured.clear()
    plan = plan_trainer_memory(again, 32768, False, min_tokens=1200, total_bytes=80 * GiB,
                               measure=lambda modes, sizes: measure(modes, sizes) if again.shard.reshard_after_forward
                               else {m: _oom(m, 76.3) for m in modes})
    assert again.keep_logits_bytes == 0 and plan.reshard_after_forward and measured == [(False,), (True,)]
    assert plan.note.startswith("memory: the LM head's logits recomputed in backward, not kept (no micro-batch "
                                "budget fit with them kept); turned --fsdp-reshard-after-forward on (no micro-batch "
                                "budget fit")


def test_out_of_memory_in_a_step_is_one_line_and_keeps_the_checkpoint(tmp_path, capsys, monkeypatch):
    import torch
    from test_cli import assets as _assets  # noqa: F401
    from test_cli import run_cli, train_flags
    from tiny_checkpoints import write_tiny_checkpoint

    from furlong.run import loop
    from furlong.tasks.synthetic import prepare_synthetic
    a = tmp_path / "a"
    write_tiny_checkpoint(a / "ckpt", vocab_size=128, hidden=32, layers=2, heads=2, kv_heads=1)
    prepare_synthetic(a / "data", 8, 2, 0)
    save = tmp_path / "ck"
    code, _, err = run_cli(train_flags(a, tmp_path / "out", "--num-rollout", "1", "--save", str(save)), capsys)
    assert code == 0, err
    before = sorted(p.name for p in save.iterdir())

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr(loop, "rl_step", oom)
    code, _, err = run_cli(train_flags(a, tmp_path / "out", "--num-rollout", "2", "--save", str(save),
                                       "--load", str(save)), capsys)
    assert code == 1
    line = err.strip().splitlines()[-1]
    assert "out of memory in the rollout stage of rollout 2" in line and "--max-tokens-per-gpu" in line
    # the flags this run does not use yet; an engine off the GPU has no weights to release
    assert "--gradient-checkpointing" in line and "--lora-rank" in line and "--offload-rollout-level" not in line
    assert "Traceback" not in err
    assert sorted(p.name for p in save.iterdir()) == before


def _oom(recompute: bool, held_gib: float) -> ModeProbe:
    return ModeProbe(recompute, (4096, 8192), (int(held_gib * GiB),) * 2, (0.0, 0.0), out_of_memory=True)


def test_out_of_memory_line_names_only_the_flags_not_in_use():
    """An 8B run with recompute and resharding on, its engine's weights resident on the GPU: the line
    offers releasing them and the flags still off, not what is already on."""
    off = memory_flags_off(reshard_after_forward=True, lora=False, cpu_offload=False, engine_weights_free=False)
    line = out_of_memory_line("train", 0, 8192, recompute=True, flags_off=off)
    assert "(micro-batches of up to 8192 tokens)" in line and "rollout 1" in line
    assert "--offload-rollout-level kv_cache weight" in line and "--lora-rank" in line
    assert "--fsdp-reshard-after-forward" not in line and "--gradient-checkpointing" not in line
    everything = out_of_memory_line("train", 0, None, recompute=True, flags_off=())
    assert everything.endswith("or use more GPUs (the last checkpoint is untouched; resume with --load)")


def test_a_mode_whose_probe_ran_out_of_memory_is_left_out():
    """Qwen3-8B full-parameter with --optimizer-cpu-offload on an 80 GB card: the 4096-token probe without
    recompute ran out of memory (on an H100); the recompute mode's probes decide the plan alone."""
    p = probes()
    p[False] = _oom(False, 76.3)
    plan = plan_memory(p, BUDGET, 32768, False, min_tokens=1200)
    assert plan.gradient_checkpointing and plan.max_tokens_per_gpu == 32768
    assert "32768 tokens per micro-batch would run out of memory (a 4096-token probe did)" in plan.note
    auto = plan_memory(p, BUDGET, None, False, min_tokens=1200)
    assert auto.gradient_checkpointing


def test_every_mode_out_of_memory_is_one_line_naming_the_flags():
    with pytest.raises(MemoryPlanError) as e:
        plan_memory({False: _oom(False, 76.3), True: _oom(True, 76.3)}, BUDGET, 32768, False, min_tokens=1200)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--max-tokens-per-gpu: a 4096-token probe micro-batch ran out of memory")
    assert "76.3 GiB" in msg and "--fsdp-reshard-after-forward" in msg and "--lora-rank" in msg
    with pytest.raises(MemoryPlanError, match="with recompute, beside"):   # recompute asked for: only its mode
        plan_memory({True: _oom(True, 70.0)}, BUDGET, 32768, True, min_tokens=1200)
    # recompute's probe ran out and no budget fits without it: the figure is the measured mode's
    tight = MemoryBudget(total_bytes=80 * GiB, reserved_bytes=8 * GiB, pending_bytes=0)
    with pytest.raises(MemoryPlanError, match=r"without recompute needs 81\.\d GiB of 60\.0 GiB usable \(with "
                                              r"recompute its probe ran out of memory\)"):
        plan_memory({False: probes(fixed_gib=70)[False], True: _oom(True, 70.0)}, tight, 32768, False,
                    min_tokens=4096)
    # a flag the run already uses is not suggested again
    with pytest.raises(MemoryPlanError) as e:
        plan_memory({True: _oom(True, 70.0)}, BUDGET, 32768, True, min_tokens=1200, flags_off=("--lora-rank",))
    assert str(e.value).endswith("; add --lora-rank, or use more GPUs") and "reshard" not in str(e.value)
    with pytest.raises(MemoryPlanError, match=r"; use more GPUs$"):
        plan_memory({True: _oom(True, 70.0)}, BUDGET, 32768, True, min_tokens=1200, flags_off=())


def test_probe_modes_records_an_out_of_memory_probe_and_cleans_up(monkeypatch):
    """The probe's OutOfMemoryError (CUDA) becomes an out_of_memory ModeProbe; the gradients the failed
    micro-batch left are dropped and the recompute flag is put back (CUDA calls stubbed on the CPU)."""
    import types
    import torch
    from furlong.trainer import memory_probe as mp
    calls = []
    model = types.SimpleNamespace(gradient_checkpointing=False)
    actor = types.SimpleNamespace(model=model, keep_logits_bytes=5, ctx=types.SimpleNamespace(device="cuda:0"),
                                  optimizer=types.SimpleNamespace(zero_grad=lambda set_to_none: calls.append("zero")))

    def timed(a, n):
        if not a.model.gradient_checkpointing:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 10 * n, n * 1e-5
    monkeypatch.setattr(mp, "_timed_probe", timed)
    monkeypatch.setattr(mp, "reshard_all", lambda m: calls.append("reshard"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 7 * GiB)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    out = mp.probe_modes(actor)
    assert out[False].out_of_memory and out[False].peak_bytes == (7 * GiB, 7 * GiB)
    assert not out[True].out_of_memory and out[True].peak_bytes == (10 * mp.PROBE_TOKENS, 20 * mp.PROBE_TOKENS)
    assert calls == ["zero", "reshard", "empty"]
    assert model.gradient_checkpointing is False and actor.keep_logits_bytes == 5


def _agree_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist
    from furlong.trainer.memory_plan import MemoryPlan
    from furlong.trainer.memory_probe import agree_on_plan
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        fits = MemoryPlan(8192 if rank == 0 else 4096, rank == 1, 0, None)
        agreed = agree_on_plan(fits)
        results[(rank, "plan")] = (agreed.max_tokens_per_gpu, agreed.gradient_checkpointing)
        # rank 1 finds no plan: both ranks raise, neither waits in a collective the other skips
        mine, error = (None, MemoryPlanError("--max-tokens-per-gpu: rank 1's own line")) if rank else (fits, None)
        try:
            agree_on_plan(mine, error)
            results[(rank, "error")] = None
        except MemoryPlanError as e:
            results[(rank, "error")] = str(e)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_tightest_plan_and_all_fail_together():
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_agree_worker, args=(port, results), nprocs=2, join=True)
        results = dict(results)
    assert results[(0, "plan")] == results[(1, "plan")] == (4096, True)
    assert results[(1, "error")] == "--max-tokens-per-gpu: rank 1's own line"
    assert results[(0, "error")].startswith("--max-tokens-per-gpu: another rank found no micro-batch budget")


def test_after_a_probe_runs_out_of_memory_the_actor_still_trains(tmp_path, monkeypatch):
    """A real (CPU, FSDP2) actor whose no-recompute probe raises OutOfMemoryError inside a decoder layer's
    forward: the recompute mode's probes then run forward and backward through the same FSDP modules, and
    no gradient is left behind (CUDA memory calls stubbed; PROBE_TOKENS cut to keep it small)."""
    import torch

    from furlong.trainer import memory_probe as mp
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 3 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 2 * GiB)
    monkeypatch.setattr(mp, "PROBE_TOKENS", 64)
    actor = _actor(_tiny_ckpt(tmp_path))
    layer = actor.model.layers[1]
    ran = []

    def hook(module, args):
        ran.append(actor.model.gradient_checkpointing)
        if not actor.model.gradient_checkpointing:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    layer.register_forward_pre_hook(hook)
    out = mp.probe_modes(actor)
    assert out[False].out_of_memory and not out[True].out_of_memory
    assert out[True].peak_bytes == (3 * GiB, 3 * GiB) and ran[0] is False and True in ran
    assert all(p.grad is None for p in actor.model.parameters())


def test_no_granule_multiple_fits_but_the_longest_sample_does():
    """A budget of exactly the longest sample (1173 tokens) when 1024 is too short for it and 2048 does not
    fit: trained, not refused."""
    p = ModeProbe(True, (1024, 2048), (int(70 * GiB), int(71 * GiB)), (0.1, 0.2))   # 1 MiB a token
    budget = MemoryBudget(total_bytes=int(70.5 * GiB), reserved_bytes=0, pending_bytes=0, safety_fraction=0.0)
    plan = plan_memory({False: _oom(False, 70), True: p}, budget, 32768, False, min_tokens=1173)
    assert (plan.max_tokens_per_gpu, plan.gradient_checkpointing) == (1173, True)
    with pytest.raises(MemoryPlanError):                                         # 1600 tokens: 70.56 GiB
        plan_memory({False: _oom(False, 70), True: p}, budget, 32768, False, min_tokens=1600)


def test_when_nothing_fits_and_samples_are_short_the_plan_probes_below_the_lm_head_chunk(tmp_path):
    """Qwen3-8B full-parameter on an 80 GB card: the 4096/8192-token probes' line, flat in the LM head's
    chunk buffers, refuses the 1173-token longest sample; probes at 1024 and 2048 tokens measure the
    chunk shrinking and the plan fits. Longest samples of 4096 tokens or more are not probed again."""
    from furlong.trainer.actor import Actor
    from furlong.trainer.memory_probe import plan_trainer_memory
    ckpt = _tiny_ckpt(tmp_path)
    calls = []

    def measure(modes, sizes):   # ~3 GiB of chunk buffers at 4096 tokens, 1.2 MiB a token below it
        calls.append((modes, sizes))
        chunk = lambda n: min(n, 4096) * 0.75 * 2**20   # noqa: E731
        return {m: ModeProbe(m, sizes, tuple(int(62 * GiB + chunk(n) + n * 0.4 * 2**20) for n in sizes),
                             (0.1, 0.2)) for m in modes}

    def fresh() -> Actor:   # nothing left to turn off: the logits recomputed, resharding after forward on
        actor = _actor(ckpt)
        actor.keep_logits_bytes = 0
        actor.enable_reshard_after_forward()
        return actor

    plan = plan_trainer_memory(fresh(), 32768, False, min_tokens=1173, measure=measure, total_bytes=75 * GiB)
    assert [s for _, s in calls] == [(4096, 8192), (4096, 8192), (1024, 2048), (1024, 2048)]
    assert 1173 <= plan.max_tokens_per_gpu < 4096 and not plan.reshard_after_forward
    assert plan.note.startswith("memory: measured again with 1024- and 2048-token probes (below the LM head's "
                                "chunk); ")
    calls.clear()
    with pytest.raises(MemoryPlanError, match=r"4096-token micro-batch.*usable; add"):
        plan_trainer_memory(fresh(), 32768, False, min_tokens=4096, measure=measure, total_bytes=75 * GiB)
    assert all(s == (4096, 8192) for _, s in calls)
    # the small probes themselves run out of memory (an 8B run on an H100 did): the line keeps what the
    # larger probes measured, and says the small ones ran
    with pytest.raises(MemoryPlanError, match=r"even a 1173-token micro-batch .* needs .* usable; .*\(measured again "
                                              r"with 1024- and 2048-token probes\)$"):
        plan_trainer_memory(fresh(), 32768, False, min_tokens=1173, total_bytes=75 * GiB, measure=lambda modes, sizes:
                            measure(modes, sizes) if sizes == (4096, 8192) else {m: _oom(m, 31.7) for m in modes})


def test_recompute_is_never_predicted_cheaper_per_token_than_without():
    """Recompute adds a forward, so at the same budget it cannot be faster: a recompute probe timed fast by
    noise (here 10% under no recompute's slope) must not win over a lowered budget without it."""
    GB = 2**20
    no = ModeProbe(False, (4096, 8192), (int(40 * GiB + 4096 * 2.9 * GB), int(40 * GiB + 8192 * 2.9 * GB)),
                   (4096e-5, 8192e-5))
    noisy = ModeProbe(True, (4096, 8192), (int(40 * GiB + 4096 * 0.9 * GB), int(40 * GiB + 8192 * 0.9 * GB)),
                      (4096 * 0.9e-5, 8192 * 0.9e-5))
    plan = plan_memory({False: no, True: noisy}, BUDGET, 32768, False, min_tokens=1200)
    assert not plan.gradient_checkpointing and plan.max_tokens_per_gpu < 32768
    # a real per-micro-batch fixed cost still lets recompute's larger budget win (it amortises it)
    slow_split = probes(intercept_s=0.5)
    assert plan_memory(slow_split, BUDGET, 32768, False, min_tokens=1200).gradient_checkpointing
