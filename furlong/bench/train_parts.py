"""Bench parts that train: `train`, `budget` and the HF fwd+bwd baseline `hf`.

  train    compute_log_probs and Actor.train_step on all samples (one warm-up
           each; the train step's time is the median of TIMED_TRAIN_STEPS), micro-batches
           per rank and their balance, the same step with --micro-batch-size 1 and no
           dynamic batching, weight sync, peak memory
  budget   train_step and the log-prob forward at several --max-tokens-per-gpu
           values (OOM is caught and reported), and `auto`'s choice if available
  hf       plain transformers fwd+bwd on the same samples: bf16, sdpa, padded
           batches filled up to the same token budget (padded tokens count
           against it), CE over all real tokens; tokens/s counts real tokens
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable

import torch
import torch.nn.functional as F

from furlong.bench.measure import OOM_ERRORS, PartTimeout, free_memory, peak_gib, rate, reset_peak, timed
from furlong.bench.report import BudgetResult, BudgetRow, HfTrainResult, TrainResult
from furlong.bench.state import Bench, build_hf_model
from furlong.trainer.mfu import mfu as train_mfu
from furlong.trainer.mfu import model_flops_per_token
from furlong.types import TrainSample

TIMED_TRAIN_STEPS = 3



def part_train(b: Bench) -> TrainResult:
    from furlong.config_map import passes_config
    from furlong.trainer.planning import balance_stats, plan_micro_batches, split_across_ranks
    actor, dev, samples, steps = b.actor(), b.device, b.train_samples(), b.steps()
    lengths = [s.num_tokens for s in samples]
    num_tokens = sum(lengths)
    actor.compute_log_probs(samples, steps, "old")                              # warm-up
    reset_peak(dev)
    _, logp_s = timed(lambda: actor.compute_log_probs(samples, steps, "old"), dev)
    logp_peak = peak_gib(dev)
    actor.train_step(samples, steps)                                            # warm-up
    reset_peak(dev)
    # the median of a few steps: a single timed step has been seen 30% off on the H200
    runs = [timed(lambda: actor.train_step(samples, steps), dev) for _ in range(TIMED_TRAIN_STEPS)]
    tm, train_all = runs[-1][0], [s for _, s in runs]
    train_s = statistics.median(train_all)
    optimizer_s = statistics.median(m.optimizer_step_seconds for m, _ in runs)   # within train_s
    train_peak = peak_gib(dev)
    mine = split_across_ranks(lengths, b.ctx.world_size)[b.ctx.rank]
    stats = balance_stats([lengths[i] for i in mine], plan_micro_batches([lengths[i] for i in mine],
                                                                         steps.max_tokens_per_gpu))
    flops = model_flops_per_token(actor.model)   # 6 x params; about 4 x under LoRA (trainer/mfu.py)
    mfu = train_mfu(flops, num_tokens, train_s, dev, b.ctx.world_size) if dev.type == "cuda" else None
    print(f"[bench] train: log-probs {logp_s:.2f}s, train_step {train_s:.2f}s (median of "
          f"{', '.join(f'{t:.3f}' for t in train_all)}; optimizer step {optimizer_s:.3f}s), "
          f"{tm.num_micro_batches} micro-batches", flush=True)

    mbs1_s = mbs1_mb = None
    try:
        if not b.w.compare_mbs1:
            raise _Skipped("train.compare_micro_batch_size_1 is false in the workload")
        mbs1 = dataclasses.replace(steps, use_dynamic_batch_size=False, micro_batch_size=1)
        tm1, mbs1_s = timed(lambda: actor.train_step(samples, mbs1), dev)
        mbs1_mb = tm1.num_micro_batches
    except PartTimeout:
        raise
    except Exception as e:   # the comparison is optional; report why it is missing
        print(f"[bench] train: micro-batch-size 1 comparison skipped: {e}", flush=True)

    sync_s, sync_bytes, note = None, None, "ok"
    try:
        from furlong.trainer.weight_sync import sync_weights
        bucket = b.w.update_weight_buffer_size
        sync_weights(actor.model, b.engine(), bucket)                           # warm-up
        sync_bytes, sync_s = timed(lambda: sync_weights(actor.model, b.engine(), bucket), dev)
    except PartTimeout:
        raise
    except Exception as e:
        note = f"weight sync unavailable: {e!r}"
    return TrainResult(
        world_size=b.ctx.world_size, num_samples=len(samples), num_tokens=num_tokens,
        reuses_old_log_probs=passes_config(b.config()).old == "training",
        log_probs_s=logp_s, log_probs_tok_per_s=rate(num_tokens, logp_s), log_probs_peak_gib=logp_peak,
        train_step_s=train_s, train_step_s_all=train_all, train_tok_per_s=rate(num_tokens, train_s),
        train_mfu=mfu, train_peak_gib=train_peak,
        num_micro_batches=tm.num_micro_batches, micro_batch_max_tokens=stats.max_tokens,
        micro_batch_mean_tokens=stats.mean_tokens, micro_batch_imbalance=stats.imbalance,
        rank_tokens_max_over_mean=tm.tokens_max_over_mean,
        mbs1_train_step_s=mbs1_s, mbs1_tok_per_s=None if mbs1_s is None else rate(num_tokens, mbs1_s),
        mbs1_num_micro_batches=mbs1_mb,
        dynamic_over_mbs1_speedup=None if mbs1_s is None else mbs1_s / train_s,
        weight_sync_s=sync_s, weight_sync_gib=None if sync_bytes is None else sync_bytes / 2**30,
        planned_max_tokens=None if b.plan is None else b.plan.max_tokens_per_gpu,
        gradient_checkpointing=bool(actor.model.gradient_checkpointing), cpu_offload=b.cpu_offload,
        optimizer_offload=b.optimizer_offload, reshard_after_forward=actor.shard.reshard_after_forward,
        offload_weights=b.offload_weights,
        optimizer_step_s=optimizer_s,
        memory_note=None if b.plan is None else b.plan.note,
        weight_sync_note=note)


def _guarded_measure(fn: Callable[[], Any], dev: torch.device, actor: Any
                     ) -> tuple[str, float | None, float | None]:
    """(status, seconds, peak GiB) of fn(); OOM (or another error) is a row's result, not the part's."""
    free_memory(dev)
    reset_peak(dev)
    try:
        _, s = timed(fn, dev)
        return "ok", s, peak_gib(dev)
    except PartTimeout:
        raise
    except Exception as e:
        # cuBLAS/cuDNN report a failed allocation as a RuntimeError, not OutOfMemoryError
        oom = isinstance(e, OOM_ERRORS) or any(m in str(e) for m in ("out of memory", "ALLOC_FAILED"))
        status = "oom" if oom else f"error: {type(e).__name__}: {e}".splitlines()[0][:300]
        peak = peak_gib(dev)
        actor.optimizer.zero_grad(set_to_none=True)
        free_memory(dev)
        return status, None, peak


def _auto_budget(b: Bench) -> tuple[int | None, str]:
    """The budget run set-up's memory plan picks for --max-tokens-per-gpu auto, the engine's weights
    reserved as in a colocated run (unless released)."""
    from furlong.trainer.memory_probe import plan_trainer_memory
    reserved = b.engine_reserved_bytes()
    plan = plan_trainer_memory(b.actor(), None, False, min_tokens=max(b.w.sample_lengths()), reserved_bytes=reserved)
    return plan.max_tokens_per_gpu, (f"recompute {'on' if plan.gradient_checkpointing else 'off'}, engine weights "
                                     f"reserved: {reserved / 2**30:.2f} GiB" + (f"; {plan.note}" if plan.note else ""))


def part_budget(b: Bench) -> BudgetResult:
    from furlong.trainer.planning import plan_micro_batches
    actor, dev, samples = b.actor(), b.device, b.train_samples()
    lengths = [s.num_tokens for s in samples]
    num_tokens, rows = sum(lengths), []
    try:   # first, while no OOM has disturbed the allocator
        auto, note = _auto_budget(b)
    except PartTimeout:
        raise
    except Exception as e:
        auto, note = None, f"memory_probe failed: {e!r}"
    print(f"[bench] budget auto: {auto} ({note})", flush=True)
    # Without recompute first; then the budgets that ran out of memory again with
    # --gradient-checkpointing (the log-prob forward has no activations to recompute).
    plan = [(budget, False) for budget in b.w.budgets]
    try:
        for budget, ckpt in plan:
            if ckpt and not actor.model.gradient_checkpointing:
                # a fresh actor: an out-of-memory error inside FSDP's backward leaves its
                # parameters half-gathered, which the recompute then trips over
                b.release_actor()
                free_memory(dev)
                actor = b.actor()
                actor.model.gradient_checkpointing = True
            steps = dataclasses.replace(b.steps(), max_tokens_per_gpu=budget)
            t_status, t_s, t_peak = _guarded_measure(lambda: actor.train_step(samples, steps), dev, actor)
            l_status, l_s, l_peak = _guarded_measure(lambda: actor.compute_log_probs(samples, steps, "old"), dev,
                                                     actor)
            rows.append(BudgetRow(
                max_tokens_per_gpu=budget, num_micro_batches=len(plan_micro_batches(lengths, budget)),
                train_status=t_status, train_s=t_s, train_tok_per_s=None if t_s is None else rate(num_tokens, t_s),
                train_peak_gib=t_peak, log_probs_status=l_status, log_probs_s=l_s,
                log_probs_tok_per_s=None if l_s is None else rate(num_tokens, l_s), log_probs_peak_gib=l_peak,
                gradient_checkpointing=ckpt))
            print(f"[bench] budget {budget} (recompute {ckpt}): train {t_status} {t_s}, "
                  f"log-probs {l_status} {l_s}", flush=True)
            if not ckpt and t_status != "ok":
                plan.append((budget, True))
    finally:
        actor.model.gradient_checkpointing = False
        actor = None
    return BudgetResult(rows=rows, auto_max_tokens=auto, auto_note=note)


def hf_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Longest first; a row joins while rows x (longest row) stays within budget (a longer row sits alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class _Skipped(Exception):
    pass


def _chunk_ce(lm_head: Any, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(lm_head(hidden).float(), labels, ignore_index=-100, reduction="sum")


def _hf_fwd_bwd(hf: Any, samples: list[TrainSample], idx: list[int], dev: torch.device,
                chunk: int = 4096) -> None:
    """One padded micro-batch: CE over every real next token, summed, then backward. The LM head
    and CE run over chunks of positions under activation checkpointing, so the [tokens, vocab] fp32
    logits never exist whole (the usual fix for HF training at long token budgets)."""
    from torch.utils.checkpoint import checkpoint
    width = max(samples[i].num_tokens for i in idx)
    ids = torch.zeros(len(idx), width, dtype=torch.long)
    mask = torch.zeros(len(idx), width, dtype=torch.long)
    for r, i in enumerate(idx):
        ids[r, :samples[i].num_tokens], mask[r, :samples[i].num_tokens] = samples[i].token_ids, 1
    labels = torch.cat([ids[:, 1:], torch.zeros(len(idx), 1, dtype=torch.long)], 1)
    labels[torch.cat([mask[:, 1:], torch.zeros(len(idx), 1, dtype=torch.long)], 1) == 0] = -100
    ids, mask, labels = ids.to(dev), mask.to(dev), labels.to(dev).flatten()
    hidden = hf.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state.flatten(0, 1)
    loss = sum(checkpoint(_chunk_ce, hf.lm_head, hidden[s:s + chunk], labels[s:s + chunk], use_reentrant=False)
               for s in range(0, hidden.shape[0], chunk))
    loss.backward()


def part_hf(b: Bench) -> HfTrainResult:
    """HF fwd+bwd at our token budget (chunked LM head + CE); if it does not fit, at half of it (noted)."""
    dev, samples = b.device, b.train_samples()
    hf = build_hf_model(b.engine(), b.w.model, b.dtype, dev).train()
    lengths = [s.num_tokens for s in samples]
    budgets = [b.w.max_tokens_per_gpu, b.w.max_tokens_per_gpu // 2]
    secs = peak = None
    try:
        for k, budget in enumerate(budgets):
            plan = hf_micro_batches(lengths, budget)
            oom = False
            try:
                _hf_fwd_bwd(hf, samples, plan[0], dev)                          # warm-up (largest row first)
            except OOM_ERRORS:
                if k + 1 == len(budgets):
                    raise
                oom = True
            if oom:   # outside the except block, so the failed attempt's frames (and tensors) are gone
                hf.zero_grad(set_to_none=True)
                free_memory(dev)
                print(f"[bench] hf: out of memory at {budget} tokens per micro-batch; trying {budgets[k + 1]}",
                      flush=True)
                continue
            hf.zero_grad(set_to_none=True)
            reset_peak(dev)
            _, secs = timed(lambda: [_hf_fwd_bwd(hf, samples, mb, dev) for mb in plan], dev)
            peak = peak_gib(dev)
            break
    finally:
        del hf
        free_memory(dev)
    train = b.reports.get("train")
    ours = train.result.train_tok_per_s if train is not None and train.status == "ok" else None
    real = sum(lengths)
    ratio = None if ours is None else ours / rate(real, secs)
    print(f"[bench] hf: {rate(real, secs):,.0f} tok/s at {budget} tokens per micro-batch; "
          f"furlong_over_hf {ratio if ratio is None else round(ratio, 2)}", flush=True)
    return HfTrainResult(
        max_tokens_per_micro_batch=budget, num_micro_batches=len(plan), num_real_tokens=real,
        num_padded_tokens=sum(len(mb) * lengths[mb[0]] for mb in plan), seconds=secs,
        tok_per_s=rate(real, secs), peak_gib=peak, furlong_over_hf=ratio)
