"""`furlong bench --workload FILE`: one RL step of a workload, timed part by part (DESIGN.md §9).

The workload file (bench/seed_workload.json) fixes the model config, prompt
lengths, forced response lengths, train settings and a decode probe. Weights are
random (seeded, std 0.02) and token ids are random: this measures speed only.
Parts, run in this order (each in try/except under a time guard, so one call
always ends with a table and a JSON, rewritten after every part):
  train    compute_log_probs and Actor.train_step on all samples (one warm-up
           each), micro-batches per rank and their balance, the same step with
           --micro-batch-size 1 and no dynamic batching, weight sync, peak memory
  budget   train_step and the log-prob forward at several --max-tokens-per-gpu
           values (OOM is caught and reported), and `auto`'s choice if available
  hf       plain transformers fwd+bwd on the same samples: bf16, sdpa, padded
           batches filled up to the same token budget (padded tokens count
           against it), CE over all real tokens; tokens/s counts real tokens
  rollout  the engine generates the responses with ignore_eos. Deviation: the
           Generator takes one max_new_tokens per call, so all samples decode
           together for max(response_lens) steps and are cut to their forced
           lengths. That is also what a real step costs: a static batch runs
           until its longest response ends. tok/s counts the forced tokens.
  decode   the decode probe (B x P prompt, exactly N new tokens) on the engine and
           on transformers `generate` (same weights, sampling, sdpa). If HF's
           warm-up predicts more than `hf_max_seconds` (default 60) for N tokens,
           HF runs fewer tokens and the engine is re-run at that count for the ratio.
The "whole step" is rollout + train_step + weight sync (+ the log-prob forward
only when the step cannot reuse the training forward's log-probs).
Timings synchronize the device before reading clocks. Peak memory is
torch.cuda.max_memory_allocated, reset before each measurement (None on CPU).
Time: each part has a SIGALRM guard (PART_GUARD_S on CUDA), and no part starts
once FURLONG_BENCH_TIME_S (default 480) is spent; skipped and timed-out parts
are reported as such. The file is long for one concept (the whole bench) but
every part is a short function; split per part if it grows.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from furlong.config import Config
from furlong.models.decoder import Transformer
from furlong.models.hf_config import ModelArgs
from furlong.types import TrainSample

PART_ORDER = ("train", "budget", "hf", "rollout", "decode")
# Per-part wall-clock guards (s) on CUDA; the whole run also stops starting parts
# once FURLONG_BENCH_TIME_S (default 480 s: the device call allows 9 minutes) is spent.
PART_GUARD_S = {"train": 150, "budget": 120, "hf": 90, "rollout": 150, "decode": 170}
DEFAULT_BUDGETS = [32768, 65536, 131072, 200000]
OOM_ERRORS = (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else (torch.cuda.OutOfMemoryError,)
HF_PEAK_FLOPS = 989e12   # dense bf16 per H100/H200 (datasheet), for MFU only


# --------------------------------------------------------------------------- workload

@dataclass
class Workload:
    name: str
    model: dict[str, Any]          # HF config.json fields
    prompt_lens: list[int]         # [num_prompts]
    response_lens: list[int]       # [num_prompts * n_samples]; sample i answers prompt i // n_samples
    n_samples_per_prompt: int
    temperature: float
    top_p: float
    top_k: int
    global_batch_size: int
    use_dynamic_batch_size: bool
    max_tokens_per_gpu: int
    optimizer: str
    lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    eps_clip: float
    eps_clip_high: float
    update_weight_buffer_size: int  # bytes per weight-sync bucket
    budgets: list[int]              # --max-tokens-per-gpu values of the budget sweep
    decode_batch: int
    decode_prompt_len: int
    decode_new_tokens: int
    hf_max_seconds: float           # cap on the HF generate run of the decode probe

    @property
    def num_samples(self) -> int:
        return len(self.response_lens)

    def sample_lengths(self) -> list[int]:
        """Prompt + response tokens of each sample [num_samples]."""
        n = self.n_samples_per_prompt
        return [self.prompt_lens[i // n] + r for i, r in enumerate(self.response_lens)]


def load_workload(path: str | Path) -> Workload:
    """Parse a workload JSON; ValueError names the file and key."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--workload: {path} not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--workload: {path} is not valid JSON ({e})") from None

    def get(section: str, key: str, default: Any = ...) -> Any:
        block = raw.get(section)
        if not isinstance(block, dict) or (key not in block and default is ...):
            raise ValueError(f"--workload: {path}: missing key {section}.{key}")
        return block.get(key, default)

    if not isinstance(raw.get("model"), dict):
        raise ValueError(f"--workload: {path}: missing key 'model' (an HF config)")
    n = int(get("rollout", "n_samples_per_prompt"))
    prompt_lens = [int(x) for x in get("rollout", "prompt_lens")]
    response_lens = [int(x) for x in get("rollout", "response_lens")]
    if n < 1 or not prompt_lens or len(response_lens) != len(prompt_lens) * n:
        raise ValueError(f"--workload: {path}: rollout.response_lens has {len(response_lens)} entries, "
                         f"expected len(prompt_lens) * n_samples_per_prompt = {len(prompt_lens) * n}")
    if min(prompt_lens + response_lens) < 1:
        raise ValueError(f"--workload: {path}: rollout.prompt_lens/response_lens must be >= 1")
    eps = float(get("train", "eps_clip", 0.2))
    w = Workload(
        name=str(raw.get("name", path.stem)), model=raw["model"], prompt_lens=prompt_lens,
        response_lens=response_lens, n_samples_per_prompt=n,
        temperature=float(get("rollout", "temperature", 1.0)), top_p=float(get("rollout", "top_p", 1.0)),
        top_k=int(get("rollout", "top_k", -1)),
        global_batch_size=int(get("train", "global_batch_size", len(response_lens))),
        use_dynamic_batch_size=bool(get("train", "use_dynamic_batch_size", True)),
        max_tokens_per_gpu=int(get("train", "max_tokens_per_gpu")), optimizer=str(get("train", "optimizer", "adam")),
        lr=float(get("train", "lr", 1e-6)), weight_decay=float(get("train", "weight_decay", 0.0)),
        adam_beta1=float(get("train", "adam_beta1", 0.9)), adam_beta2=float(get("train", "adam_beta2", 0.95)),
        eps_clip=eps, eps_clip_high=float(get("train", "eps_clip_high", eps)),
        update_weight_buffer_size=int(get("train", "update_weight_buffer_size", 512 * 1024**2)),
        budgets=[int(b) for b in get("train", "budget_sweep", DEFAULT_BUDGETS)],
        decode_batch=int(get("decode_probe", "batch")), decode_prompt_len=int(get("decode_probe", "prompt_len")),
        decode_new_tokens=int(get("decode_probe", "new_tokens")),
        hf_max_seconds=float(get("decode_probe", "hf_max_seconds", 60.0)),
    )
    ModelArgs.from_hf_config(w.model, source=f"{path}: model")   # validates the config now
    return w


def parse_parts(parts: str) -> list[str]:
    names = list(PART_ORDER) if parts.strip() == "all" else [p.strip() for p in parts.split(",") if p.strip()]
    bad = [p for p in names if p not in PART_ORDER]
    if bad or not names:
        raise ValueError(f"--parts: unknown part(s) {bad} (all, or a comma list of {', '.join(PART_ORDER)})")
    return [p for p in PART_ORDER if p in names]


# --------------------------------------------------------------------------- results

@dataclass
class TrainResult:
    world_size: int
    num_samples: int
    num_tokens: int                  # prompt + response tokens of the step
    reuses_old_log_probs: bool       # True: the real loop skips the separate log-prob forward
    log_probs_s: float
    log_probs_tok_per_s: float
    log_probs_peak_gib: float | None
    train_step_s: float              # fwd+bwd of all micro-batches + clip + optimizer step
    train_tok_per_s: float
    train_mfu: float | None          # 6 * params * tokens/s over the bf16 peak (CUDA only)
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


@dataclass
class BudgetResult:
    rows: list[BudgetRow]
    auto_max_tokens: int | None      # memory_probe's choice for --max-tokens-per-gpu auto
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
    max_new_tokens: int              # decode steps of the batch
    num_forced_tokens: int           # sum of forced response lengths (the useful tokens)
    seconds: float
    tok_per_s: float                 # forced tokens / s
    decoded_slots_per_s: float       # num_samples * max_new_tokens / s
    peak_gib: float | None
    note: str


@dataclass
class DecodeResult:
    batch: int
    prompt_len: int
    new_tokens: int
    furlong_s: float
    furlong_tok_per_s: float
    furlong_peak_gib: float | None
    hf_new_tokens: int               # < new_tokens when capped by hf_max_seconds
    hf_s: float
    hf_tok_per_s: float
    hf_peak_gib: float | None
    furlong_at_hf_tokens_tok_per_s: float   # the engine at hf_new_tokens (same as furlong_tok_per_s if equal)
    furlong_over_hf: float
    note: str


@dataclass
class PartReport:
    name: str
    status: str = "skipped"          # ok | error | timeout | skipped
    seconds: float = 0.0
    error: str = ""
    result: Any = None               # one of the *Result dataclasses


# --------------------------------------------------------------------------- helpers

class PartTimeout(Exception):
    pass


@contextmanager
def time_guard(seconds: float):
    """Raise PartTimeout in the main thread after `seconds` (no-op where SIGALRM is unavailable)."""
    usable = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if not usable or seconds <= 0:
        yield
        return

    def fire(signum, frame):
        raise PartTimeout(f"time guard of {seconds:.0f} s reached")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _rate(num: float, seconds: float) -> float:
    return num / seconds if seconds > 0 else float("inf")


class NullTokenizer:
    """The engine decodes response text at the end; random ids have no text, so decode to ""."""
    pad_token_id = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""


# --------------------------------------------------------------------------- models and data

class Bench:
    """Shared state of one bench run: device, seeded models (built lazily), results."""

    def __init__(self, workload: Workload, seed: int = 0):
        from furlong.train.distributed import init_distributed
        self.w, self.seed = workload, seed
        self.owns_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        self.ctx = init_distributed("auto")
        self.device = self.ctx.device
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.args = ModelArgs.from_hf_config(workload.model, source="workload model")
        self._engine: Transformer | None = None
        self._actor: Any = None
        self.reports: dict[str, PartReport] = {}

    def random_model(self) -> Transformer:
        """fp32 Transformer with the run's seeded init, built directly on the device."""
        torch.manual_seed(self.seed)
        with torch.device(self.device):
            return Transformer(self.args)

    def engine(self) -> Transformer:
        """The rollout engine's copy: same initial weights as the actor, in the compute dtype."""
        if self._engine is None:
            self._engine = self.random_model().to(self.dtype).eval()
        return self._engine

    def config(self, **batch_overrides: Any) -> Config:
        w, cfg = self.w, Config()
        cfg.rollout.rollout_batch_size = len(w.prompt_lens)
        cfg.rollout.n_samples_per_prompt = w.n_samples_per_prompt
        cfg.rollout.rollout_temperature, cfg.rollout.rollout_top_p = w.temperature, w.top_p
        cfg.rollout.rollout_top_k = w.top_k
        cfg.rollout.rollout_max_response_len = max(w.response_lens)
        cfg.algo.eps_clip, cfg.algo.eps_clip_high = w.eps_clip, w.eps_clip_high
        o = cfg.optim
        o.optimizer, o.lr, o.weight_decay, o.adam_beta1, o.adam_beta2 = (w.optimizer, w.lr, w.weight_decay,
                                                                          w.adam_beta1, w.adam_beta2)
        b = cfg.batch
        b.global_batch_size, b.use_dynamic_batch_size = w.global_batch_size, w.use_dynamic_batch_size
        b.max_tokens_per_gpu, b.update_weight_buffer_size = str(w.max_tokens_per_gpu), w.update_weight_buffer_size
        cfg.batch = dataclasses.replace(b, **batch_overrides)
        return cfg

    def actor(self):
        if self._actor is None:
            from furlong.train.actor import Actor
            self._actor = Actor(self.random_model(), self.config(), self.ctx)
        return self._actor

    def release_actor(self) -> None:
        self._actor = None
        _free_memory(self.device)

    def train_samples(self) -> list[TrainSample]:
        """Random prompt/response ids with the forced lengths; one GRPO-like advantage per sample."""
        w, n = self.w, self.w.n_samples_per_prompt
        g = torch.Generator().manual_seed(self.seed + 1)
        prompts = [torch.randint(0, self.args.vocab_size, (p,), generator=g) for p in w.prompt_lens]
        out = []
        for i, r in enumerate(w.response_lens):
            resp = torch.randint(0, self.args.vocab_size, (r,), generator=g)
            out.append(TrainSample(token_ids=torch.cat([prompts[i // n], resp]), num_prompt_tokens=len(prompts[i // n]),
                                   advantages=torch.full((r,), float(torch.randn((), generator=g))),
                                   rollout_log_probs=-torch.rand(r, generator=g) * 5))
        return out


def build_hf_model(engine: Transformer, model_cfg: dict[str, Any], dtype: torch.dtype, device: torch.device):
    """transformers' model for this config (sdpa) holding a copy of `engine`'s weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from furlong.models.hf_io import hf_state_dict
    kw = {k: v for k, v in model_cfg.items() if k not in ("architectures", "torch_dtype", "dtype", "model_type")}
    hf_cfg = AutoConfig.for_model(model_cfg["model_type"], **kw)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=dtype)
    missing, unexpected = hf.load_state_dict(hf_state_dict(engine.state_dict()), strict=False)
    allowed = {"lm_head.weight"} if model_cfg.get("tie_word_embeddings") else set()
    if set(missing) - allowed or unexpected:
        raise ValueError(f"bench: HF model does not match ours (missing {missing}, unexpected {unexpected})")
    hf.tie_weights()
    hf.generation_config.eos_token_id = None   # exactly max_new_tokens tokens per row
    hf.generation_config.pad_token_id = 0
    return hf


# --------------------------------------------------------------------------- parts

def part_train(b: Bench) -> TrainResult:
    from furlong.train.batching import balance_stats, plan_micro_batches, split_across_ranks
    actor, dev, samples = b.actor(), b.device, b.train_samples()
    lengths = [s.num_tokens for s in samples]
    num_tokens = sum(lengths)
    actor.compute_log_probs(samples, "old")                                     # warm-up
    _reset_peak(dev)
    _, logp_s = timed(lambda: actor.compute_log_probs(samples, "old"), dev)
    logp_peak = _peak_gib(dev)
    actor.train_step(samples)                                                   # warm-up
    _reset_peak(dev)
    tm, train_s = timed(lambda: actor.train_step(samples), dev)
    train_peak = _peak_gib(dev)
    mine = split_across_ranks(lengths, b.ctx.world_size)[b.ctx.rank]
    stats = balance_stats([lengths[i] for i in mine], plan_micro_batches([lengths[i] for i in mine],
                                                                         actor.max_tokens_per_gpu))
    num_params = sum(p.numel() for p in b.engine().parameters())
    mfu = (6 * num_params * _rate(num_tokens, train_s) / (HF_PEAK_FLOPS * b.ctx.world_size)
           if dev.type == "cuda" else None)
    print(f"[bench] train: log-probs {logp_s:.2f}s, train_step {train_s:.2f}s, "
          f"{tm.num_micro_batches} micro-batches", flush=True)

    mbs1_s = mbs1_mb = None
    dyn_cfg = actor.cfg
    try:
        # Actor reads its batch flags from self.cfg at every step: swap them for the comparison.
        actor.cfg = b.config(use_dynamic_batch_size=False, micro_batch_size=1)
        tm1, mbs1_s = timed(lambda: actor.train_step(samples), dev)
        mbs1_mb = tm1.num_micro_batches
    except PartTimeout:
        raise
    except Exception as e:   # the comparison is optional; report why it is missing
        print(f"[bench] train: micro-batch-size 1 comparison failed: {e!r}", flush=True)
    finally:
        actor.cfg = dyn_cfg

    sync_s, sync_bytes, note = None, None, "ok"
    try:
        from furlong.train.weight_sync import sync_weights
        bucket = b.w.update_weight_buffer_size
        sync_weights(actor.model, b.engine(), bucket)                           # warm-up
        sync_bytes, sync_s = timed(lambda: sync_weights(actor.model, b.engine(), bucket), dev)
    except PartTimeout:
        raise
    except Exception as e:
        note = f"weight sync unavailable: {e!r}"
    return TrainResult(
        world_size=b.ctx.world_size, num_samples=len(samples), num_tokens=num_tokens,
        reuses_old_log_probs=actor.reuses_old_log_probs(len(samples)),
        log_probs_s=logp_s, log_probs_tok_per_s=_rate(num_tokens, logp_s), log_probs_peak_gib=logp_peak,
        train_step_s=train_s, train_tok_per_s=_rate(num_tokens, train_s), train_mfu=mfu, train_peak_gib=train_peak,
        num_micro_batches=tm.num_micro_batches, micro_batch_max_tokens=stats.max_tokens,
        micro_batch_mean_tokens=stats.mean_tokens, micro_batch_imbalance=stats.imbalance,
        rank_tokens_max_over_mean=tm.tokens_max_over_mean,
        mbs1_train_step_s=mbs1_s, mbs1_tok_per_s=None if mbs1_s is None else _rate(num_tokens, mbs1_s),
        mbs1_num_micro_batches=mbs1_mb,
        dynamic_over_mbs1_speedup=None if mbs1_s is None else mbs1_s / train_s,
        weight_sync_s=sync_s, weight_sync_gib=None if sync_bytes is None else sync_bytes / 2**30,
        weight_sync_note=note)


def _guarded_measure(fn: Callable[[], Any], dev: torch.device, actor: Any
                     ) -> tuple[str, float | None, float | None]:
    """(status, seconds, peak GiB) of fn(); OOM (or another error) is a row's result, not the part's."""
    _free_memory(dev)
    _reset_peak(dev)
    try:
        _, s = timed(fn, dev)
        return "ok", s, _peak_gib(dev)
    except PartTimeout:
        raise
    except Exception as e:
        # cuBLAS/cuDNN report a failed allocation as a RuntimeError, not OutOfMemoryError
        oom = isinstance(e, OOM_ERRORS) or any(m in str(e) for m in ("out of memory", "ALLOC_FAILED"))
        status = "oom" if oom else f"error: {type(e).__name__}: {e}".splitlines()[0][:300]
        peak = _peak_gib(dev)
        actor.optimizer.zero_grad(set_to_none=True)
        _free_memory(dev)
        return status, None, peak


def _auto_budget(b: Bench) -> tuple[int | None, str]:
    """memory_probe's budget, with the engine's weights reserved as in a colocated run."""
    try:
        from furlong.train.memory_probe import probe_max_tokens
    except ImportError as e:
        return None, f"memory_probe unavailable: {e!r}"
    reserved = sum(p.numel() * p.element_size() for p in b.engine().parameters())
    return probe_max_tokens(b.actor(), reserved_bytes=reserved), f"engine weights reserved: {reserved / 2**30:.2f} GiB"


def part_budget(b: Bench) -> BudgetResult:
    from furlong.train.batching import plan_micro_batches
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
    saved = actor.max_tokens_per_gpu
    try:
        for budget in b.w.budgets:
            actor.max_tokens_per_gpu = budget   # the Actor plans with this attribute at every step
            t_status, t_s, t_peak = _guarded_measure(lambda: actor.train_step(samples), dev, actor)
            l_status, l_s, l_peak = _guarded_measure(lambda: actor.compute_log_probs(samples, "old"), dev, actor)
            rows.append(BudgetRow(
                max_tokens_per_gpu=budget, num_micro_batches=len(plan_micro_batches(lengths, budget)),
                train_status=t_status, train_s=t_s, train_tok_per_s=None if t_s is None else _rate(num_tokens, t_s),
                train_peak_gib=t_peak, log_probs_status=l_status, log_probs_s=l_s,
                log_probs_tok_per_s=None if l_s is None else _rate(num_tokens, l_s), log_probs_peak_gib=l_peak))
            print(f"[bench] budget {budget}: train {t_status} {t_s}, log-probs {l_status} {l_s}", flush=True)
    finally:
        actor.max_tokens_per_gpu = saved
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


def _hf_fwd_bwd(hf: Any, samples: list[TrainSample], idx: list[int], dev: torch.device) -> None:
    """One padded micro-batch: CE over every real next token, summed, then backward."""
    width = max(samples[i].num_tokens for i in idx)
    ids = torch.zeros(len(idx), width, dtype=torch.long)
    mask = torch.zeros(len(idx), width, dtype=torch.long)
    for r, i in enumerate(idx):
        ids[r, :samples[i].num_tokens], mask[r, :samples[i].num_tokens] = samples[i].token_ids, 1
    labels = torch.cat([ids[:, 1:], torch.zeros(len(idx), 1, dtype=torch.long)], 1)
    labels[torch.cat([mask[:, 1:], torch.zeros(len(idx), 1, dtype=torch.long)], 1) == 0] = -100
    ids, mask, labels = ids.to(dev), mask.to(dev), labels.to(dev)
    logits = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits   # no KV cache in training
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    loss.backward()


def part_hf(b: Bench) -> HfTrainResult:
    dev, samples = b.device, b.train_samples()
    hf = build_hf_model(b.engine(), b.w.model, b.dtype, dev).train()
    lengths = [s.num_tokens for s in samples]
    plan = hf_micro_batches(lengths, b.w.max_tokens_per_gpu)
    try:
        _hf_fwd_bwd(hf, samples, plan[0], dev)                                  # warm-up
        hf.zero_grad(set_to_none=True)
        _reset_peak(dev)
        _, secs = timed(lambda: [_hf_fwd_bwd(hf, samples, mb, dev) for mb in plan], dev)
        peak = _peak_gib(dev)
    finally:
        del hf
        _free_memory(dev)
    train = b.reports.get("train")
    ours = train.result.train_tok_per_s if train is not None and train.status == "ok" else None
    real = sum(lengths)
    return HfTrainResult(
        max_tokens_per_micro_batch=b.w.max_tokens_per_gpu, num_micro_batches=len(plan), num_real_tokens=real,
        num_padded_tokens=sum(len(mb) * lengths[mb[0]] for mb in plan), seconds=secs,
        tok_per_s=_rate(real, secs), peak_gib=peak,
        furlong_over_hf=None if ours is None else ours / _rate(real, secs))


def _generator(b: Bench, batch: int):
    from furlong.rollout.generator import Generator
    return Generator(b.engine(), NullTokenizer(), eos_token_ids=[], max_batch_size=batch, device=b.device)


def _sampling(b: Bench, new_tokens: int, seed: int = 0):
    from furlong.rollout.sampling import SamplingParams
    return SamplingParams(temperature=b.w.temperature, top_p=b.w.top_p, top_k=b.w.top_k,
                          max_new_tokens=new_tokens, ignore_eos=True, seed=seed)


def part_rollout(b: Bench) -> RolloutResult:
    w, dev = b.w, b.device
    g = torch.Generator().manual_seed(b.seed + 2)
    prompts = [torch.randint(0, b.args.vocab_size, (p,), generator=g).tolist() for p in w.prompt_lens]
    batch = [prompts[i // w.n_samples_per_prompt] for i in range(w.num_samples)]
    gen, max_new = _generator(b, w.num_samples), max(w.response_lens)
    gen.generate(batch, _sampling(b, min(8, max_new)))                           # warm-up
    _reset_peak(dev)
    outs, secs = timed(lambda: gen.generate(batch, _sampling(b, max_new)), dev)
    short = [i for i, (o, r) in enumerate(zip(outs, w.response_lens)) if len(o.token_ids) < r]
    if short:
        raise RuntimeError(f"engine stopped early on {len(short)} samples despite ignore_eos (first: {short[0]})")
    forced = sum(len(o.token_ids[:r]) for o, r in zip(outs, w.response_lens))
    return RolloutResult(
        num_samples=w.num_samples, max_new_tokens=max_new, num_forced_tokens=forced, seconds=secs,
        tok_per_s=_rate(forced, secs), decoded_slots_per_s=_rate(w.num_samples * max_new, secs),
        peak_gib=_peak_gib(dev),
        note="one generate call at max(response_lens) with ignore_eos, responses cut to their forced lengths")


def part_decode(b: Bench) -> DecodeResult:
    w, dev = b.w, b.device
    g = torch.Generator().manual_seed(b.seed + 3)
    prompts = torch.randint(0, b.args.vocab_size, (w.decode_batch, w.decode_prompt_len), generator=g)
    gen, n = _generator(b, w.decode_batch), w.decode_new_tokens

    def ours(num_new: int) -> tuple[float, float | None]:
        _reset_peak(dev)
        _, s = timed(lambda: gen.generate(prompts.tolist(), _sampling(b, num_new)), dev)
        return s, _peak_gib(dev)

    gen.generate(prompts.tolist(), _sampling(b, min(8, n)))                      # warm-up
    our_s, our_peak = ours(n)
    print(f"[bench] decode: engine {our_s:.2f}s for {n} tokens", flush=True)
    hf = build_hf_model(b.engine(), w.model, b.dtype, dev).eval()
    ids = prompts.to(dev)
    top_k = 0 if w.top_k == -1 else w.top_k   # 0: no top-k filter

    def hf_gen(num_new: int, max_time: float | None = None) -> int:
        """New tokens per row that HF produced (fewer than num_new only if max_time cut it)."""
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                              max_new_tokens=num_new, min_new_tokens=num_new, temperature=w.temperature,
                              top_p=w.top_p, top_k=top_k, pad_token_id=0, max_time=max_time)
        return out.shape[1] - ids.shape[1]

    try:
        probe = min(16, n)
        _, warm_s = timed(lambda: hf_gen(probe), dev)                          # warm-up and estimate
        # Later steps attend over longer caches: assume 1.5x the warm-up's time per token.
        estimate = warm_s / probe * n * 1.5
        hf_n, note = n, "same token count"
        if estimate > w.hf_max_seconds:
            hf_n = max(probe, min(n, int(w.hf_max_seconds / (warm_s / probe * 1.5)) // 16 * 16))
            note = (f"HF generate of {n} tokens estimated at {estimate:.0f}s > {w.hf_max_seconds:.0f}s: "
                    f"HF ran {hf_n} tokens; ratio compares the engine at {hf_n} tokens too")
        _reset_peak(dev)
        # max_time: a hard stop in case the estimate was optimistic; tok/s uses what was produced
        planned = hf_n
        hf_n, hf_s = timed(lambda: hf_gen(planned, max_time=1.5 * w.hf_max_seconds), dev)
        hf_peak = _peak_gib(dev)
        if hf_n < planned:
            note += f"; HF stopped by max_time after {hf_n} of {planned} tokens"
    finally:
        del hf
        _free_memory(dev)
    at_hf_s = our_s if hf_n == n else ours(hf_n)[0]
    hf_rate, ours_rate = _rate(w.decode_batch * hf_n, hf_s), _rate(w.decode_batch * hf_n, at_hf_s)
    return DecodeResult(
        batch=w.decode_batch, prompt_len=w.decode_prompt_len, new_tokens=n, furlong_s=our_s,
        furlong_tok_per_s=_rate(w.decode_batch * n, our_s), furlong_peak_gib=our_peak, hf_new_tokens=hf_n,
        hf_s=hf_s, hf_tok_per_s=hf_rate, hf_peak_gib=hf_peak, furlong_at_hf_tokens_tok_per_s=ours_rate,
        furlong_over_hf=ours_rate / hf_rate, note=note)


PARTS: dict[str, Callable[[Bench], Any]] = {
    "train": part_train, "budget": part_budget, "hf": part_hf, "rollout": part_rollout, "decode": part_decode,
}


# --------------------------------------------------------------------------- report

@dataclass
class StepSummary:
    rollout_s: float | None
    log_probs_s: float | None        # 0 when the step reuses the training forward's log-probs
    train_step_s: float | None
    weight_sync_s: float | None
    whole_step_s: float | None       # None unless every term was measured


def step_summary(reports: dict[str, PartReport]) -> StepSummary:
    ok = lambda name: reports[name].result if name in reports and reports[name].status == "ok" else None  # noqa: E731
    ro, tr = ok("rollout"), ok("train")
    rollout_s = ro.seconds if ro else None
    logp = None if tr is None else (0.0 if tr.reuses_old_log_probs else tr.log_probs_s)
    terms = [rollout_s, logp, tr.train_step_s if tr else None, tr.weight_sync_s if tr else None]
    return StepSummary(rollout_s, logp, terms[2], terms[3], None if None in terms else sum(terms))


def _fmt(v: Any) -> str:
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
                rows.append((name, f"max_tokens={r.max_tokens_per_gpu}",
                             f"mb={r.num_micro_batches} train {r.train_status} {_fmt(r.train_tok_per_s)} tok/s "
                             f"peak {_fmt(r.train_peak_gib)} GiB | logp {r.log_probs_status} "
                             f"{_fmt(r.log_probs_tok_per_s)} tok/s peak {_fmt(r.log_probs_peak_gib)} GiB"))
            rows.append((name, "auto_max_tokens", f"{res.auto_max_tokens} ({res.auto_note})"))
        elif res is not None:
            rows.extend((name, k, _fmt(v)) for k, v in dataclasses.asdict(res).items())
    rows.extend(("step", k, _fmt(v)) for k, v in dataclasses.asdict(summary).items())
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    return "\n".join(f"{a:<{w0}}  {b_:<{w1}}  {c}" for a, b_, c in rows)


def _environment(b: Bench) -> dict[str, Any]:
    import platform

    import transformers
    from furlong.models.attention import select_packed_impl
    probe = torch.empty(1, 1, 1, dtype=b.dtype, device=b.device)
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(b.device) if b.device.type == "cuda" else "cpu",
            "world_size": b.ctx.world_size, "dtype": str(b.dtype), "packed_attention": select_packed_impl(probe)}


def _write_json(path: Path | None, payload: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def run_bench(workload_path: str, output_path: str | None = None, parts: str = "all") -> int:
    """Run the selected parts; print a table; write JSON (output_path, else $OUT/bench.json).

    Returns 0 when every selected part finished, 1 otherwise (the JSON is written either way).
    """
    names = parse_parts(parts)
    w = load_workload(workload_path)
    out = Path(output_path) if output_path else (Path(os.environ["OUT"]) / "bench.json" if os.environ.get("OUT")
                                                 else None)
    b = Bench(w)
    total_s = float(os.environ.get("FURLONG_BENCH_TIME_S", "480"))
    t_start = time.perf_counter()
    payload: dict[str, Any] = {"workload": w.name, "workload_file": str(workload_path), "parts": {}}
    try:
        payload["environment"] = _environment(b)
        print(f"[bench] {w.name}: {w.num_samples} samples, {sum(w.sample_lengths())} tokens, parts {names}, "
              f"{payload['environment']}", flush=True)
        for name in names:
            rep = b.reports[name] = PartReport(name)
            left = total_s - (time.perf_counter() - t_start)
            guard = min(PART_GUARD_S[name], left - 5) if b.device.type == "cuda" else left - 5
            if guard < 15:
                rep.error = f"only {left:.0f}s left of the {total_s:.0f}s bench budget"
            else:
                print(f"[bench] part {name} (guard {guard:.0f}s)", flush=True)
                t = time.perf_counter()
                try:
                    with time_guard(guard):
                        rep.result = PARTS[name](b)
                    rep.status = "ok"
                except PartTimeout as e:
                    rep.status, rep.error = "timeout", str(e)
                except Exception as e:   # report and go on: one call must yield every part it can
                    rep.status, rep.error = "error", f"{type(e).__name__}: {e}".splitlines()[0][:500]
                    traceback.print_exc()
                rep.seconds = time.perf_counter() - t
                _free_memory(b.device)
                print(f"[bench] part {name}: {rep.status} in {rep.seconds:.1f}s {rep.error}", flush=True)
            if name == "budget" or (name == "train" and "budget" not in names):
                b.release_actor()   # training state is not needed by later parts; HF and rollout need the memory
            payload["parts"][name] = dataclasses.asdict(rep)
            _write_json(out, payload)
        summary = step_summary(b.reports)
        payload["step"] = dataclasses.asdict(summary)
        payload["total_s"] = time.perf_counter() - t_start
        _write_json(out, payload)
        print("\n" + format_table(b.reports, summary), flush=True)
        if out is not None:
            print(f"[bench] wrote {out}", flush=True)
    finally:
        if b.owns_group:
            from furlong.train.distributed import destroy_distributed
            destroy_distributed()
    return 0 if all(r.status == "ok" for r in b.reports.values()) else 1
