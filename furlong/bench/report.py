"""Bench results: one dataclass per part, the step summary, the JSON file and the table.

The "whole step" is rollout + train_step + weight sync (+ the log-prob forward
only when the step cannot reuse the training forward's log-probs); it is None
unless every term was measured. The JSON is written atomically (tmp + rename)
so a run killed mid-write still leaves the previous complete file.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class TrainResult:
    world_size: int
    num_samples: int
    num_tokens: int                  # prompt + response tokens of the step
    reuses_old_log_probs: bool       # True: the real loop skips the separate log-prob forward
    log_probs_s: float
    log_probs_tok_per_s: float
    log_probs_peak_gib: float | None
    train_step_s: float              # fwd+bwd of all micro-batches + clip + optimizer step (median)
    train_step_s_all: list[float]    # [TIMED_TRAIN_STEPS] each timed step, after one warm-up step
    train_tok_per_s: float
    train_mfu: float | None          # train FLOPs/token (trainer/mfu.py) * tokens/s over the bf16 peak (CUDA)
    train_peak_gib: float | None
    num_micro_batches: int           # per rank
    micro_batch_max_tokens: int      # of this rank's plan (rank 0)
    micro_batch_mean_tokens: float
    micro_batch_imbalance: float     # max / mean tokens per micro-batch
    rank_tokens_max_over_mean: float
    mbs1_train_step_s: float | None  # --micro-batch-size 1, no dynamic batching
    mbs1_tok_per_s: float | None
    mbs1_num_micro_batches: int | None
    dynamic_over_mbs1_speedup: float | None
    weight_sync_s: float | None
    weight_sync_gib: float | None    # bytes written into the engine
    weight_sync_note: str
    planned_max_tokens: int | None = None   # the memory plan's budget (run set-up's rule; None off CUDA)
    gradient_checkpointing: bool = False    # recompute, as asked or as the plan turned it on
    cpu_offload: bool = False               # --fsdp-cpu-offload
    optimizer_offload: bool = False         # --optimizer-cpu-offload
    reshard_after_forward: bool = False     # --fsdp-reshard-after-forward, as given or as the plan turned it on
    offload_weights: bool = False           # --offload-rollout-level weight: no engine weights reserved
    optimizer_step_s: float | None = None   # the timed steps' optimizer.step() (device time, median of the steps)
    memory_note: str | None = None          # the plan's line when it departed from the workload's flags


@dataclass
class BudgetRow:
    max_tokens_per_gpu: int
    num_micro_batches: int
    train_status: str                # ok | oom | error: ...
    train_s: float | None
    train_tok_per_s: float | None
    train_peak_gib: float | None
    log_probs_status: str
    log_probs_s: float | None
    log_probs_tok_per_s: float | None
    log_probs_peak_gib: float | None
    gradient_checkpointing: bool = False


@dataclass
class BudgetResult:
    rows: list[BudgetRow]
    auto_max_tokens: int | None      # the memory plan's choice for --max-tokens-per-gpu auto
    auto_note: str


@dataclass
class HfTrainResult:
    max_tokens_per_micro_batch: int  # padded tokens (rows x longest row) per micro-batch
    num_micro_batches: int
    num_real_tokens: int
    num_padded_tokens: int
    seconds: float
    tok_per_s: float                 # real tokens
    peak_gib: float | None
    furlong_over_hf: float | None    # furlong train tok/s / HF tok/s (needs the train part)


@dataclass
class RolloutResult:
    num_samples: int
    max_new_tokens: int              # longest forced response
    num_forced_tokens: int           # sum of forced response lengths (every token generated)
    seconds: float                   # a later rollout: new KV session, graphs kept (what each step pays)
    tok_per_s: float                 # forced tokens / s
    first_seconds: float             # the run's first rollout: CUDA-graph captures included
    decode_steps: int
    decode_steps_per_s: float
    mean_running_batch: float        # rows per decode step
    kv_utilization: float            # mean used / total KV pages per decode window
    num_preemptions: int
    peak_gib: float | None           # torch allocations (the KV cache is mapped outside them)
    kv_cache_gib: float              # KV cache mapped for the session (--rollout-kv-fraction of free memory)
    cascade_row_fraction: float      # decode rows that read their prompt's KV once per group (cascade)
    no_cascade_seconds: float | None  # the same later rollout with cascade off, same run (None: no row used it)
    note: str


@dataclass
class EvalProbeResult:
    num_prompts: int
    max_new_tokens: int
    num_generated_tokens: int
    seconds: float
    tok_per_s: float
    decode_steps: int
    mean_running_batch: float
    num_preemptions: int
    peak_gib: float | None
    kv_cache_gib: float
    note: str


@dataclass
class DecodeResult:
    batch: int
    prompt_len: int
    new_tokens: int
    furlong_s: float
    furlong_tok_per_s: float
    furlong_ms_per_step: float
    furlong_peak_gib: float | None
    hf_new_tokens: int               # < new_tokens when capped by hf_max_seconds
    hf_s: float
    hf_tok_per_s: float
    hf_peak_gib: float | None
    furlong_at_hf_tokens_tok_per_s: float   # the engine at hf_new_tokens (same as furlong_tok_per_s if equal)
    furlong_over_hf: float
    note: str


@dataclass
class TrlResult:
    trl_version: str
    num_samples: int                 # completions per optimizer step, both sides (prompts x n_samples_per_prompt)
    response_len: int                # every response, both sides: the workload's mean response length (EOS off)
    num_tokens: int                  # prompt + response tokens of one step
    micro_batch_size: int            # TRL per_device_train_batch_size
    gradient_accumulation_steps: int  # TRL micro-batches per optimizer step (one generation batch)
    warmup_steps: int
    timed_steps: int                 # TRL steps in the median (fewer than asked only if the guard cut the run)
    trl_steps_s: list[float]         # every TRL step (generate + fwd/bwd + optimizer), warm-ups first
    trl_step_s: float                # median of the timed steps
    trl_peak_gib: float | None
    furlong_rollout_s: float         # the rollout part's `seconds` at the fixed length
    furlong_log_probs_s: float       # 0 when the step reuses the training forward's log-probs
    furlong_train_step_s: float
    furlong_weight_sync_s: float | None
    furlong_step_s: float | None     # rollout + log-probs + train_step + weight sync
    furlong_over_trl: float | None   # trl_step_s / furlong_step_s
    note: str


@dataclass
class RlStepResult:
    """The rlstep part: K real RL steps with --partial-rollout (partial_*, lists [K]), then steps 2..K again
    without it (plain_*, lists [K - 1]) on the same warm engine and actor (bench/rl_step_part.py)."""
    num_steps: int
    rollout_batch_size: int          # groups kept per step
    over_sampling_batch_size: int    # groups drawn per submission
    n_samples_per_prompt: int
    plain_step_s: list[float]        # rollout .. weight sync, as the loop's perf/step_time less eval and save
    plain_rollout_s: list[float]
    plain_train_s: list[float]       # the actor's train step
    plain_generated_tokens: list[int]   # response tokens generated (aborted ones too)
    plain_trained_tokens: list[int]     # response tokens of the kept samples
    plain_aborted_groups: list[int]
    plain_resumed_samples: list[int]    # samples continued from an earlier step: 0 (plain steps drop paused groups)
    partial_step_s: list[float]
    partial_rollout_s: list[float]
    partial_train_s: list[float]
    partial_generated_tokens: list[int]
    partial_trained_tokens: list[int]
    partial_aborted_groups: list[int]
    partial_resumed_samples: list[int]   # samples of paused groups continued in the step
    partial_paused_samples: list[int]    # samples paused at the step's end
    partial_offpolicy_token_frac: list[float]   # kept response tokens made by an earlier step's weights
    plain_step_s_after_first: float | None      # mean over plain steps 2..K (None: K = 1)
    partial_step_s_after_first: float | None
    partial_speedup: float | None               # plain / partial, steps 2..K
    note: str
    offload_weights: bool = False    # --offload-rollout-level weight: engine weights released while training


@dataclass
class PartReport:
    name: str
    status: str = "skipped"          # ok | error | timeout | skipped
    seconds: float = 0.0
    error: str = ""
    result: Any = None               # one of the *Result dataclasses


@dataclass
class StepSummary:
    rollout_s: float | None
    log_probs_s: float | None        # 0 when the step reuses the training forward's log-probs
    train_step_s: float | None
    weight_sync_s: float | None
    whole_step_s: float | None       # None unless every term was measured
    # the trl part's ratio (TRL's step / furlong's, both at one fixed response length, so it is not
    # whole_step_s's forced per-sample lengths); None unless the trl part ran
    furlong_over_trl: float | None = None


def step_summary(reports: dict[str, PartReport]) -> StepSummary:
    ok = lambda name: reports[name].result if name in reports and reports[name].status == "ok" else None  # noqa: E731
    ro, tr = ok("rollout"), ok("train")
    rollout_s = ro.seconds if ro else None
    logp = None if tr is None else (0.0 if tr.reuses_old_log_probs else tr.log_probs_s)
    terms = [rollout_s, logp, tr.train_step_s if tr else None, tr.weight_sync_s if tr else None]
    trl = ok("trl")
    return StepSummary(rollout_s, logp, terms[2], terms[3], None if None in terms else sum(terms),
                       furlong_over_trl=trl.furlong_over_trl if trl else None)


def _fmt(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def format_table(reports: dict[str, PartReport], summary: StepSummary) -> str:
    rows = []
    for name, rep in reports.items():
        rows.append((name, "status", f"{rep.status} ({rep.seconds:.1f}s)" + (f": {rep.error}" if rep.error else "")))
        res = rep.result
        if isinstance(res, BudgetResult):
            for r in res.rows:
                rows.append((name, f"max_tokens={r.max_tokens_per_gpu}" + (" +recompute" if r.gradient_checkpointing else ""),
                             f"mb={r.num_micro_batches} train {r.train_status} {_fmt(r.train_tok_per_s)} tok/s "
                             f"peak {_fmt(r.train_peak_gib)} GiB | logp {r.log_probs_status} "
                             f"{_fmt(r.log_probs_tok_per_s)} tok/s peak {_fmt(r.log_probs_peak_gib)} GiB"))
            rows.append((name, "auto_max_tokens", f"{res.auto_max_tokens} ({res.auto_note})"))
        elif res is not None:
            rows.extend((name, k, _fmt(v)) for k, v in dataclasses.asdict(res).items())
    rows.extend(("step", k, _fmt(v)) for k, v in dataclasses.asdict(summary).items())
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    return "\n".join(f"{a:<{w0}}  {b_:<{w1}}  {c}" for a, b_, c in rows)


def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    os.replace(tmp, path)
