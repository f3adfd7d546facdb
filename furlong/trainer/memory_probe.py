"""The memory probes behind the trainer's memory plan (memory_plan.py; docs/design.md §5).

On CUDA, with the model sharded and idle, two probe micro-batches (PROBE_TOKENS and 2x that) each run
the training path (forward_packed -> chunked log-probs with entropy -> loss -> backward) and the no-grad
log-prob forward, in each recompute mode asked for, and we read torch.cuda.max_memory_allocated and the
time of each. Each measured run follows a warm-up run whose gradients it keeps: every micro-batch of a
step after the first runs its forward with the whole step's gradients held (fp32, 4 bytes per trained
parameter), and a probe without them measured a peak short by up to the smaller of the gradients and
the activations (Qwen3-8B: a first step ran out of memory 3+ GiB above the planned peak). Peak memory
is affine in the token count above the LM head's chunk (logprobs.CHUNK_TOKENS), so two points give the slope (bytes
per token) and the intercept; the plan raises the intercept by the AdamW state (2 fp32 tensors per
local parameter) when the optimizer has not allocated it yet, and by the LM-head logits a training
forward keeps for its backward (actor.keep_logits_bytes): they grow with the tokens only up to that
cap, so the probes run without them and the whole cap counts as fixed memory. plan_trainer_memory
turns these into the run's budget and recompute mode (with `auto` or a given --max-tokens-per-gpu),
and when nothing fits, drops the kept logits, then reshards after forward and probes again, then
probes at SMALL_PROBE_SIZES, below the chunk.

On CPU there is nothing to measure: the given budget, or CPU_DEFAULT_TOKENS for `auto` (with a line).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from furlong.trainer.batching import move_micro_batch, pack_micro_batch, response_positions, to_device
from furlong.launch.distributed import all_reduce_max
from furlong.trainer.fsdp import reshard_all
from furlong.trainer.logprobs import CHUNK_TOKENS
from furlong.trainer.memory_plan import (MemoryBudget, MemoryPlan, MemoryPlanError, ModeProbe, memory_flags_off,
                                         plan_memory)
from furlong.types import TrainSample

if TYPE_CHECKING:
    from furlong.trainer.actor import Actor

PROBE_TOKENS = 4096
PROBE_SIZES = (PROBE_TOKENS, 2 * PROBE_TOKENS)
# when no budget fits and the longest sample is shorter than the LM head's chunk: probes inside it
SMALL_PROBE_SIZES = (CHUNK_TOKENS // 4, CHUNK_TOKENS // 2)
CPU_DEFAULT_TOKENS = 16384


def _probe_batch(num_tokens: int, vocab_size: int, device: torch.device):
    """One packed sample of `num_tokens` tokens, every position trained with unit weight; -> (micro-batch,
    its response slices: the one sample's num_tokens - 1 response log-probs)."""
    g = torch.Generator().manual_seed(0)
    r = num_tokens - 1
    sample = TrainSample(token_ids=torch.randint(0, vocab_size, (num_tokens,), generator=g), num_prompt_tokens=1,
                         advantages=torch.ones(r), rollout_log_probs=torch.zeros(r))
    return move_micro_batch(pack_micro_batch([sample], [torch.full((r,), 1.0 / r)], [0]), device), [(0, r)]


def _measure(actor: Actor, num_tokens: int, keep_grads: bool = False) -> int:
    """Peak bytes of one training micro-batch and one log-prob forward of `num_tokens` tokens (gradients
    already held stay and accumulate; keep_grads: leave this run's gradients held, else free them all)."""
    vocab = actor.model.output_weight.shape[0]
    mb, slices = _probe_batch(num_tokens, vocab, actor.ctx.device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    positions = to_device(response_positions(slices), actor.ctx.device)
    logp, ent = actor._log_probs(actor.model, mb, positions, with_entropy=True)
    loss, _ = actor.loss_fn(mb, logp, ent.detach(), actor.cfg.loss, slices)
    loss.backward()
    with torch.no_grad():
        actor._log_probs(actor.model, mb, positions, with_entropy=False)
    reshard_all(actor.model)   # a no-grad forward leaves the gathered weights (fsdp.py)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    if not keep_grads:
        actor.optimizer.zero_grad(set_to_none=True)
    return int(peak)


# ------------------------------------------------------------------------ the memory plan (memory_plan.py)

def _timed_probe(actor: Actor, num_tokens: int) -> tuple[int, float]:
    """(peak bytes, seconds) of one training micro-batch of `num_tokens`, after an untimed run of it
    (kernels and compiled graphs warm; a first call's compile would swamp the time) whose gradients it
    accumulates into, as a step's later micro-batches do (module docstring). The time is the faster of
    two runs: the plan compares modes by these times (a close call between them is decided by them)."""
    _measure(actor, num_tokens, keep_grads=True)
    peaks, times = [], []
    for last in (False, True):
        torch.cuda.synchronize()
        t = time.perf_counter()
        peaks.append(_measure(actor, num_tokens, keep_grads=not last))
        times.append(time.perf_counter() - t)
    return max(peaks), min(times)


def probe_modes(actor: Actor, modes: tuple[bool, ...] = (False, True), sizes: tuple[int, int] = PROBE_SIZES
                ) -> dict[bool, ModeProbe]:
    """Probes of `sizes` tokens in each recompute mode of `modes` (the model's flag is toggled and put back)."""
    keep, actor.keep_logits_bytes = actor.keep_logits_bytes, 0   # module docstring: counted as fixed memory
    was = actor.model.gradient_checkpointing
    out = {}
    try:
        for recompute in modes:
            actor.model.gradient_checkpointing = recompute
            held = torch.cuda.memory_allocated(actor.ctx.device)
            try:
                (p0, t0), (p1, t1) = (_timed_probe(actor, n) for n in sizes)
                out[recompute] = ModeProbe(recompute, sizes, (p0, p1), (t0, t1))
            except torch.OutOfMemoryError:
                # the mode does not fit at the probe's size: the plan leaves it out (and says which flags
                # would help when no mode fits) instead of the run dying on a traceback in set-up
                actor.optimizer.zero_grad(set_to_none=True)
                reshard_all(actor.model)
                torch.cuda.empty_cache()
                out[recompute] = ModeProbe(recompute, sizes, (held, held), (0.0, 0.0), out_of_memory=True)
    finally:
        actor.model.gradient_checkpointing = was
        actor.keep_logits_bytes = keep
    return out


def plan_trainer_memory(actor: Actor, requested_tokens: int | None, requested_recompute: bool, min_tokens: int,
                        reserved_bytes: int = 0,
                        measure: Callable[[tuple[bool, ...], tuple[int, int]], dict[bool, ModeProbe]] | None = None,
                        total_bytes: int | None = None) -> MemoryPlan:
    """The run's memory plan (memory_plan.py), measured on this rank and agreed over ranks: every rank
    takes the smallest budget, and recompute if any rank needs it (one collective).

    When no budget fits, the plan first stops keeping the LM head's logits for backward
    (actor.keep_logits_bytes, a tenth of the GPU: planned again from the same probes), then turns
    --fsdp-reshard-after-forward on (actor.enable_reshard_after_forward), measures again and says so in
    its line: on one GPU the gathered compute-dtype copy of an 8B model is 15 GiB beside 61 GiB of fp32
    weights and gradients. Last, when the longest sample is shorter than the probes, it probes again at
    SMALL_PROBE_SIZES, which measure the LM head's chunk as it shrinks below CHUNK_TOKENS. Every rank
    decides each step together (a collective), as the probes run FSDP's collectives. On CUDA the memory
    allocated before the probes (the weights) is the budget's static_bytes (memory_plan.MemoryBudget: no
    fragmentation margin on it).

    `measure(modes, sizes)` -> {recompute: ModeProbe} replaces the probes and `total_bytes` the device's
    memory (tests on the CPU); without them a CPU run keeps its flags."""
    if measure is None and actor.ctx.device.type != "cuda":
        tokens = CPU_DEFAULT_TOKENS if requested_tokens is None else requested_tokens
        note = (f"--max-tokens-per-gpu auto: CPU run, using the default budget of {tokens} tokens"
                if requested_tokens is None else None)
        return MemoryPlan(tokens, requested_recompute, 0, note)
    measure = measure or (lambda modes, sizes: probe_modes(actor, modes, sizes))
    # trainer state not allocated yet: AdamW's two fp32 moments per trainable parameter on this device
    has_state = any(len(s) > 0 for s in actor.optimizer.state.values())
    pending = 0 if has_state else sum(2 * 4 * (p.to_local() if hasattr(p, "to_local") else p).numel()
                                      for p in actor.model.parameters()
                                      if p.requires_grad and p.device.type == actor.ctx.device.type)
    static = 0
    if total_bytes is None:
        total_bytes = torch.cuda.get_device_properties(actor.ctx.device).total_memory
        static = torch.cuda.memory_allocated(actor.ctx.device)   # the weights, before any probe
    memo: dict[bool, ModeProbe] = {}
    probe_sizes = PROBE_SIZES    # the probes' token counts now (read by `measured` when it runs)

    def measured(modes: tuple[bool, ...]) -> dict[bool, ModeProbe]:   # each mode probed once per placement
        missing = tuple(m for m in modes if m not in memo)
        if missing:
            memo.update(measure(missing, probe_sizes))
        return {m: memo[m] for m in modes}

    def plan_with(keep_bytes: int) -> tuple[MemoryPlan | None, MemoryPlanError | None]:
        budget = MemoryBudget(total_bytes, reserved_bytes, pending + keep_bytes, static_bytes=static)
        return _measured_plan(actor, measured, budget, requested_tokens, requested_recompute, min_tokens)

    def failed_anywhere(plan: MemoryPlan | None) -> bool:   # one collective: every rank takes each step
        return bool(all_reduce_max([float(plan is None)])[0])

    kept_logits = actor.keep_logits_bytes
    # what set-up changed beyond budget and recompute (for the plan's line), each with how the probes ran
    # again after it (for the error's), None when they did not
    changed: list[tuple[str, str | None]] = []
    plan, error = plan_with(kept_logits)
    if kept_logits and failed_anywhere(plan):
        # the logits kept for backward (a tenth of the GPU) go first: recomputing them costs one more LM-head
        # matmul per chunk, re-gathering every layer per micro-batch costs more (the probes ran without them)
        actor.keep_logits_bytes = 0
        plan, error = plan_with(0)
        changed.append(("the LM head's logits recomputed in backward, not kept (no micro-batch budget fit with "
                        "them kept)", None))
    resharded = not actor.shard.reshard_after_forward and failed_anywhere(plan)
    if resharded:
        actor.enable_reshard_after_forward()
        memo.clear()
        plan, error = plan_with(0)
        changed.append(("turned --fsdp-reshard-after-forward on (no micro-batch budget fit with each layer's "
                        "weights kept gathered across micro-batches)", "with --fsdp-reshard-after-forward turned on"))
    if min_tokens < min(CHUNK_TOKENS, PROBE_TOKENS) and failed_anywhere(plan):
        # below the LM head's chunk its two fp32 [chunk, V] buffers shrink with the micro-batch, which the
        # large probes' line, flat there, counts whole (by arithmetic 8 bytes x V a token: Qwen3's vocabulary,
        # ~3.4 GiB between 4096 and 1173 tokens): small probes measure that slope
        probe_sizes = SMALL_PROBE_SIZES
        memo.clear()
        large_error = error
        plan, error = plan_with(0)
        if plan is None and all(p.out_of_memory for p in memo.values()):
            error = large_error   # its line says what the larger probes measured, where these only ran out
        small = f"{SMALL_PROBE_SIZES[0]}- and {SMALL_PROBE_SIZES[1]}-token probes"
        changed.append((f"measured again with {small} (below the LM head's chunk)", f"with {small}"))
    remeasured = [how for _, how in changed if how is not None]
    if plan is not None and changed:
        plan.reshard_after_forward = resharded
        plan.note = "memory: " + "; ".join(what for what, _ in changed) + (
            f"; {plan.note.removeprefix('memory: ')}" if plan.note else
            f"; {plan.max_tokens_per_gpu} tokens per micro-batch, recompute "
            f"{'on' if plan.gradient_checkpointing else 'off'}")
    elif plan is None and remeasured:
        error = MemoryPlanError(f"{error} (measured again {' and '.join(remeasured)})")
    return agree_on_plan(plan, error)


def _measured_plan(actor: Actor, measure: Callable[[tuple[bool, ...]], dict[bool, ModeProbe]],
                   budget: MemoryBudget, requested_tokens: int | None, requested_recompute: bool, min_tokens: int
                   ) -> tuple[MemoryPlan | None, MemoryPlanError | None]:
    """This rank's plan from probes of the actor as it is placed now, or the error saying why none fits."""
    # the asked-for mode first: when its budget fits, the other mode's probes (half the start-up probing)
    # are not needed
    probes = measure((requested_recompute,))
    mine = probes[requested_recompute]
    fits = (requested_tokens is not None and requested_tokens >= min_tokens and not mine.out_of_memory
            and mine.peak(requested_tokens, budget.pending_bytes) <= budget.usable_bytes)
    # agreed (one collective): the probes run FSDP's collectives, so every rank must probe the same
    # modes, and ranks' peaks differ by a little
    if all_reduce_max([float(not fits)])[0]:
        probes.update(measure(tuple(m for m in (False, True) if m != requested_recompute)))
    # nothing reserved: the engine's weights are released while the trainer runs, or not on this GPU
    flags_off = unused_memory_flags(actor, engine_weights_free=budget.reserved_bytes == 0)
    try:
        return plan_memory(probes, budget, requested_tokens, requested_recompute, min_tokens,
                           flags_off=flags_off), None
    except MemoryPlanError as e:
        return None, e


def unused_memory_flags(actor: Actor, engine_weights_free: bool) -> tuple[str, ...]:
    """The memory flags (memory_plan.MEMORY_FLAGS) this actor's run does not use yet."""
    return memory_flags_off(actor.shard.reshard_after_forward, actor.cfg.lora is not None, actor.shard.cpu_offload,
                            engine_weights_free)


def agree_on_plan(plan: MemoryPlan | None, error: MemoryPlanError | None = None) -> MemoryPlan:
    """This rank's plan (or its MemoryPlanError) -> the plan every rank runs (one collective): the tightest
    budget, recompute if any rank needs it. When any rank found no plan, every rank raises (that rank its
    own line, the others one naming it), so no rank is left waiting in a collective the others never reach."""
    tokens, recompute, failed = all_reduce_max([-plan.max_tokens_per_gpu if plan else 0.0,
                                                float(plan.gradient_checkpointing) if plan else 0.0,
                                                float(plan is None)])
    if failed:
        raise error or MemoryPlanError("--max-tokens-per-gpu: another rank found no micro-batch budget that fits "
                                       "(its line says why)")
    if int(-tokens) != plan.max_tokens_per_gpu or bool(recompute) != plan.gradient_checkpointing:
        plan = MemoryPlan(int(-tokens), bool(recompute), plan.predicted_peak_bytes,
                          (plan.note or "memory:") + " (agreed over ranks: the tightest rank's plan)",
                          plan.reshard_after_forward)
    return plan
