"""The memory planner: budget and recompute from measured probes (pure arithmetic, CPU)."""
from __future__ import annotations

import pytest

from furlong.trainer.memory_plan import MemoryBudget, MemoryPlanError, ModeProbe, largest_fit, plan_memory

GiB = 2**30


def probes(intercept_s: float = 0.05, fixed_gib: float = 40.0):
    """A 4B-like trainer: 2.9 MiB/token without recompute, 0.9 with; recompute 1/3 slower per token."""
    no = ModeProbe(False, (4096, 8192), (int(fixed_gib * GiB + 4096 * 2.9 * 2**20), int(fixed_gib * GiB + 8192 * 2.9 * 2**20)),
                   (intercept_s + 4096e-5, intercept_s + 8192e-5))
    re = ModeProbe(True, (4096, 8192), (int(fixed_gib * GiB + 4096 * 0.9 * 2**20), int(fixed_gib * GiB + 8192 * 0.9 * 2**20)),
                   (intercept_s + 4096 * 1.33e-5, intercept_s + 8192 * 1.33e-5))
    return {False: no, True: re}


BUDGET = MemoryBudget(total_bytes=140 * GiB, reserved_bytes=8 * GiB, pending_bytes=20 * GiB)


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
    with pytest.raises(MemoryPlanError, match=r"^--max-tokens-per-gpu: .*--fsdp-cpu-offload.*--lora-rank"):
        plan_memory(probes(fixed_gib=70), tiny, 32768, False, min_tokens=4096)
    # fits only below the longest sample: refused too, never a budget a sample cannot fit in
    with pytest.raises(MemoryPlanError):
        plan_memory(probes(fixed_gib=60), tiny, None, False, min_tokens=9000)
