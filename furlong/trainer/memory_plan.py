"""The trainer's memory plan: token budget and recompute, decided from measured memory before step 1.

A user who swaps a bigger checkpoint into a working command line should get a run, not an
out-of-memory traceback in the first step. The memory probe (memory_probe.py) runs two training
micro-batches in each recompute mode (--gradient-checkpointing off and on) and records their
peak memory and time; this module decides, as pure arithmetic (tested on CPU):

  peak(mode, B)  = fixed(mode) + per_token(mode) * B        (two points per mode; affine)
  fits(mode, B) <=> peak(mode, B) <= total - reserved - safety * (total - static)
                   (static: the memory held before the probes, the weights: no margin for it)
  cost(mode, B)  = seconds per trained token at budget B: (a + b * B) / B, a and b from the
                   two timed probes (a micro-batch's fixed cost - launches, the LM head's
                   chunk loop, FSDP gathers - shrinks per token as B grows); recompute's is
                   at least no recompute's at the same B (it adds a forward), whatever the
                   probes' timing noise; the note gives the predicted rate of the plan and the
                   best plan passed over, so a close call can be checked against the step

Given --max-tokens-per-gpu B:
  * fits without recompute (or recompute was asked for and fits): B as given, no line;
  * otherwise the faster of (recompute on, B) and (recompute as asked, the largest budget
    that fits), among those that fit and hold the longest sample; one line says which and why;
  * nothing fits: MemoryPlanError naming the flags that would help (memory_probe.py first
    turns --fsdp-reshard-after-forward on, when it is off, and plans again from new probes).
With `auto`: the faster of (no recompute, largest budget that fits) and (recompute, largest
budget that fits); --gradient-checkpointing given by the user is kept on.
Budgets are multiples of GRANULE, or exactly the longest sample when no multiple both holds it and fits.

Deviation from a full memory model: fragmentation is not modelled (the safety margin is meant
to absorb it), and cost ignores attention's quadratic term (the probes pack one sample).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GRANULE = 1024          # budgets are multiples of this many tokens
SAFETY_FRACTION = 0.15  # of the device memory beside the weights, kept free for fragmentation and the allocator


class MemoryPlanError(ValueError):
    """No budget fits: the message names the flags to change (the CLI prints it as one line)."""


class TrainerOutOfMemory(RuntimeError):
    """An out-of-memory error the plan did not foresee (the CLI prints it as one line, exit 1)."""


def out_of_memory_line(stage: str, rollout_id: int, budget_tokens: int | None, recompute: bool,
                       flags_off: tuple[str, ...]) -> str:
    """What to change after a real OOM: the stage, the planned token budget (None: not known) and recompute
    mode in force, and memory_flags_off's flags the run does not use yet."""
    return (f"out of memory in the {stage} stage of rollout {rollout_id + 1}"
            + (f" (micro-batches of up to {budget_tokens} tokens)" if budget_tokens else "")
            + ": lower --max-tokens-per-gpu" + ("" if recompute else ", add --gradient-checkpointing")
            + f", or {_remedies(flags_off)} (the last checkpoint is untouched; resume with --load)")


@dataclass
class ModeProbe:
    """Two probe micro-batches in one recompute mode."""
    recompute: bool
    num_tokens: tuple[int, int]     # tokens of the small and the large probe
    peak_bytes: tuple[int, int]     # max_memory_allocated while each ran (out of memory: allocated before it)
    seconds: tuple[float, float]    # forward + backward time of each (after a warm-up run)
    out_of_memory: bool = False     # a probe of this mode ran out of memory: no budget fits in it

    def per_token_bytes(self) -> float:
        (n0, n1), (p0, p1) = self.num_tokens, self.peak_bytes
        return max((p1 - p0) / (n1 - n0), 1.0)   # a non-positive slope is noise: >= 1 byte per token

    def peak(self, tokens: int, pending_bytes: int) -> float:
        return self.peak_bytes[0] + self.per_token_bytes() * (tokens - self.num_tokens[0]) + pending_bytes

    def seconds_per_token(self, tokens: int) -> float:
        (n0, n1), (t0, t1) = self.num_tokens, self.seconds
        slope = max((t1 - t0) / (n1 - n0), 0.0)
        intercept = max(t0 - slope * n0, 0.0)
        return (intercept + slope * tokens) / tokens


@dataclass
class MemoryPlan:
    max_tokens_per_gpu: int          # the micro-batch token budget the planner packs to
    gradient_checkpointing: bool     # recompute decoder layers in backward
    predicted_peak_bytes: int        # of this plan
    note: str | None                 # one line when the plan differs from what was asked, else None
    reshard_after_forward: bool = False   # the plan turned --fsdp-reshard-after-forward on (memory_probe.py)


@dataclass
class MemoryBudget:
    total_bytes: int                 # device memory
    reserved_bytes: int              # held outside the trainer during training (the engine's weights)
    pending_bytes: int               # trainer state not yet allocated at probe time (AdamW moments, kept logits)
    safety_fraction: float = SAFETY_FRACTION
    # allocated before the probes and held all run (the trainer's weights): allocated once, never churned,
    # so the fragmentation margin is not taken of it (8B full-parameter on an 80 GB card: 31 GiB of fp32
    # weights, on which 15% would be 4.6 GiB of the little room left)
    static_bytes: int = 0

    @property
    def usable_bytes(self) -> float:
        return (self.total_bytes - self.reserved_bytes
                - self.safety_fraction * max(self.total_bytes - self.static_bytes, 0))


# what frees memory for the trainer (beyond --gradient-checkpointing and the token budget, which the plan picks)
MEMORY_FLAGS = ("--fsdp-reshard-after-forward", "--offload-rollout-level kv_cache weight", "--lora-rank",
                "--fsdp-cpu-offload")
_WHAT_IT_FREES = {"--fsdp-reshard-after-forward": "the gathered compute-dtype weights",
                  "--offload-rollout-level kv_cache weight": "the engine's weights while the trainer runs"}


def engine_reserved_bytes(engine_model: torch.nn.Module, released: bool) -> int:
    """The GPU memory the trainer's plan leaves to the engine's weights: none while they are released
    (--offload-rollout-level weight), else their bytes."""
    return 0 if released else sum(p.numel() * p.element_size() for p in engine_model.parameters())


def _remedies(flags_off: tuple[str, ...]) -> str:
    """'add A, B or C, or use more GPUs' over the memory flags a run does not use yet."""
    named = [f + (f" (frees {_WHAT_IT_FREES[f]})" if f in _WHAT_IT_FREES else "") for f in flags_off]
    if not named:
        return "use more GPUs"
    listed = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " or " + named[-1]
    return f"add {listed}, or use more GPUs"


def memory_flags_off(reshard_after_forward: bool, lora: bool, cpu_offload: bool, engine_weights_free: bool
                     ) -> tuple[str, ...]:
    """The MEMORY_FLAGS a run does not use yet; engine_weights_free: the engine's weights are released while
    the trainer runs (--offload-rollout-level weight), or not on this GPU."""
    used = {"--fsdp-reshard-after-forward": reshard_after_forward, "--lora-rank": lora,
            "--fsdp-cpu-offload": cpu_offload, "--offload-rollout-level kv_cache weight": engine_weights_free}
    return tuple(f for f in MEMORY_FLAGS if not used[f])


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f} GiB"


def _rate(seconds_per_token: float) -> str:
    return f"{1e-3 / seconds_per_token:.1f}k tok/s" if seconds_per_token > 0 else "an unmeasured rate"


def largest_fit(probe: ModeProbe, budget: MemoryBudget, granule: int = GRANULE) -> int:
    """Largest multiple of `granule` tokens whose predicted peak fits (0 when none does)."""
    room = budget.usable_bytes - probe.peak(0, budget.pending_bytes)
    return max(int(room // probe.per_token_bytes()) // granule * granule, 0)


def plan_memory(probes: dict[bool, ModeProbe], budget: MemoryBudget, requested_tokens: int | None,
                requested_recompute: bool, min_tokens: int, granule: int = GRANULE,
                flags_off: tuple[str, ...] = MEMORY_FLAGS) -> MemoryPlan:
    """The plan for --max-tokens-per-gpu `requested_tokens` (None: auto) and --gradient-checkpointing.

    probes: {False: no recompute, True: recompute}; min_tokens: the longest sample a micro-batch
    must hold (prompt + response), so no budget below it is ever chosen; flags_off: the MEMORY_FLAGS the
    run does not use yet (an error names those).
    """
    def candidate(recompute: bool, tokens: int) -> tuple[float, MemoryPlan]:
        p = probes[recompute]
        plan = MemoryPlan(tokens, recompute, int(p.peak(tokens, budget.pending_bytes)), None)
        cost = p.seconds_per_token(tokens)
        if recompute and not probes[False].out_of_memory:     # module docstring: never cheaper than without
            cost = max(cost, probes[False].seconds_per_token(tokens))
        return cost, plan

    def fits(recompute: bool, tokens: int) -> bool:
        p = probes[recompute]
        return (tokens >= min_tokens and not p.out_of_memory
                and p.peak(tokens, budget.pending_bytes) <= budget.usable_bytes)

    modes = [True] if requested_recompute else [False, True]
    if all(probes[m].out_of_memory for m in modes):
        held = probes[modes[-1]].peak_bytes[0]
        raise MemoryPlanError(
            f"--max-tokens-per-gpu: a {probes[modes[-1]].num_tokens[0]}-token probe micro-batch ran out of memory "
            f"{'with' if modes == [True] else 'with and without'} recompute, beside {_gib(held)} of weights, "
            f"gradients and optimizer state already held (of {_gib(budget.total_bytes)}); {_remedies(flags_off)}")
    if requested_tokens is not None and fits(requested_recompute, requested_tokens):
        return candidate(requested_recompute, requested_tokens)[1]
    options = []
    for recompute in modes:
        if requested_tokens is not None and fits(recompute, requested_tokens):
            options.append(candidate(recompute, requested_tokens))
        best = 0 if probes[recompute].out_of_memory else largest_fit(probes[recompute], budget, granule)
        if best < min_tokens:   # no multiple of the granule holds the longest sample: a budget of exactly it
            best = min_tokens
        if requested_tokens is not None:
            best = min(best, requested_tokens)
        if fits(recompute, best):
            options.append(candidate(recompute, best))
    if not options:
        # the figure from the mode that needs least and was measured (recompute, unless its probe ran out)
        mode = next(m for m in reversed(modes) if not probes[m].out_of_memory)
        need = probes[mode].peak(max(min_tokens, granule), budget.pending_bytes)
        raise MemoryPlanError(
            f"--max-tokens-per-gpu: even a {max(min_tokens, granule)}-token micro-batch (the longest sample) "
            f"{'with' if mode else 'without'} recompute needs {_gib(need)} of {_gib(budget.usable_bytes)} usable"
            f"{'' if mode == modes[-1] else ' (with recompute its probe ran out of memory)'}; "
            f"{_remedies(flags_off)}, or a smaller --rollout-max-response-len")
    options.sort(key=lambda o: (o[0], o[1].gradient_checkpointing))   # a tie: no recompute
    cost, plan = options[0]
    passed = next((o for o in options if (o[1].max_tokens_per_gpu, o[1].gradient_checkpointing)
                   != (plan.max_tokens_per_gpu, plan.gradient_checkpointing)), None)
    rates = f"predicted {_rate(cost)}" + (f" against {_rate(passed[0])} for {passed[1].max_tokens_per_gpu} tokens "
                                           f"with recompute {'on' if passed[1].gradient_checkpointing else 'off'}"
                                           if passed else "")
    if requested_tokens is None:
        plan.note = (f"--max-tokens-per-gpu auto: {plan.max_tokens_per_gpu} tokens, recompute "
                     f"{'on' if plan.gradient_checkpointing else 'off'} (predicted peak {_gib(plan.predicted_peak_bytes)}"
                     f" of {_gib(budget.usable_bytes)} usable; the faster per token of the two modes, {rates})")
        return plan
    mine = probes[requested_recompute]
    need = (f"would run out of memory (a {mine.num_tokens[0]}-token probe did)" if mine.out_of_memory else
            f"would need {_gib(mine.peak(requested_tokens, budget.pending_bytes))} of "
            f"{_gib(budget.usable_bytes)} usable")
    change = []
    if plan.gradient_checkpointing != requested_recompute:
        change.append("turned --gradient-checkpointing on")
    if plan.max_tokens_per_gpu != requested_tokens:
        change.append(f"lowered --max-tokens-per-gpu to {plan.max_tokens_per_gpu}")
    plan.note = (f"memory: {' and '.join(change)}: {requested_tokens} tokens per micro-batch {need}; this plan needs "
                 f"{_gib(plan.predicted_peak_bytes)} (the faster per token of the plans that fit, {rates})")
    return plan
