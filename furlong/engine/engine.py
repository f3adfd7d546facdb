"""The rollout engine: requests in, completions out, with continuous batching.

    engine = Engine(model, tokenizer, eos_token_ids, EngineConfig(...))
    engine.add(Request(...)); while engine.has_work(): done = engine.step()
    engine.generate(requests)  # the same, all at once; completions in request order
    engine.release()           # free the KV cache for the colocated trainer

Each `step` is one scheduler plan (scheduler.py): a packed prefill of newly
admitted prompts (each prompt once; its n samples fork from it and draw their
first tokens from its logits) or a decode window of `decode_window` tokens per
running sequence (model_runner.py). Finished sequences leave the running set at
the end of the window they finish in; their extra tokens of that window are
dropped, so a window of w costs each sequence at most w - 1 wasted slots.

A sequence finishes at
  * an EOS token (unless ignore_eos) or one of its stop_token_ids: the token is
    kept, finish_reason "stop";
  * a stop string: the response keeps every token up to and including the one
    completing it; the text is cut right after the string; "stop";
  * its request's max_new_tokens: "length";
  * `abort`: "abort" (what it generated so far).
The KV cache is sized on first use per session from --rollout-kv-fraction of
the free GPU memory (CPU: `cpu_kv_tokens`) and freed by `release`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from furlong.engine.block_manager import BlockManager, pages_for
from furlong.engine.model_runner import ModelRunner, StepOutput
from furlong.engine.sampling import SamplingParams
from furlong.engine.scheduler import Plan, Scheduler
from furlong.engine.sequence import Completion, Request, Sequence
from furlong.engine.stop import StopStrings, cut_after_stop


@dataclass
class EngineConfig:
    kv_fraction: float = 0.8          # of the GPU memory free when a session starts
    page_size: int = 64               # tokens per KV page
    max_num_seqs: int = 512           # running sequences (largest decode batch)
    max_prefill_tokens: int = 16384   # tokens per packed prefill
    decode_window: int = 16           # decode steps per host sync
    max_model_len: int = 4096         # prompt + response tokens of any request
    use_cuda_graphs: bool = True
    cascade: bool = True              # a group's shared prompt KV read once per decode step (cascade.py)
    cascade_min_prefix: int = 256     # tokens: shorter shared prompts are read by each row (measured no gain)
    compile: bool | None = None       # torch.compile the layer blocks (None: on CUDA)
    cpu_kv_tokens: int = 1 << 16      # KV slots on CPU, where free memory is not measured

    def __post_init__(self) -> None:
        if not 0 < self.kv_fraction <= 1:
            raise ValueError(f"--rollout-kv-fraction: must be in (0, 1], got {self.kv_fraction}")
        if not 1 <= self.decode_window <= self.page_size:
            raise ValueError(f"engine: decode_window must be in [1, page_size={self.page_size}], "
                             f"got {self.decode_window}")


@dataclass
class EngineStats:
    """Counters since the last `reset_stats` (the rollout logs them per rollout)."""
    num_prefill_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_steps: int = 0
    num_decode_rows: int = 0          # sum over decode steps of running rows
    num_grouped_rows: int = 0         # of those, rows that read their prompt's KV once per group (cascade)
    num_generated_tokens: int = 0     # kept tokens (after stops), all sequences
    num_preemptions: int = 0
    kv_used_sum: float = 0.0          # sum over decode windows of used/total pages
    num_windows: int = 0
    seconds: float = 0.0

    @property
    def mean_batch(self) -> float:
        return self.num_decode_rows / max(self.num_decode_steps, 1)

    @property
    def grouped_fraction(self) -> float:
        return self.num_grouped_rows / max(self.num_decode_rows, 1)

    @property
    def kv_utilization(self) -> float:
        return self.kv_used_sum / max(self.num_windows, 1)


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer: Any, eos_token_ids: list[int], config: EngineConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cfg = config
        on_gpu = next(model.parameters()).is_cuda
        self.runner = ModelRunner(model, config.page_size, config.max_num_seqs, config.use_cuda_graphs,
                                  compile=on_gpu if config.compile is None else config.compile,
                                  cascade=config.cascade, cascade_min_prefix=config.cascade_min_prefix)
        self.scheduler: Scheduler | None = None
        self.stats = EngineStats()
        self._next_id = 0
        self._stop_id_cache: dict[int, tuple[SamplingParams, frozenset[int]]] = {}   # id(params) -> stop ids

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def new_request_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    # ---- session -------------------------------------------------------------------------------
    def _start(self) -> None:
        cfg, runner = self.cfg, self.runner
        if runner.on_gpu:
            torch.cuda.empty_cache()     # colocated: the trainer's cached blocks are the engine's to use now
            free, _ = torch.cuda.mem_get_info(runner.device)
            num_pages = int(cfg.kv_fraction * free) // runner.page_bytes()
        else:
            num_pages = cfg.cpu_kv_tokens // cfg.page_size
        max_pages = pages_for(cfg.max_model_len + cfg.decode_window, cfg.page_size)
        blocks = BlockManager(num_pages, cfg.page_size)
        runner.allocate(num_pages, max_pages)
        self.scheduler = Scheduler(blocks, cfg.max_num_seqs, cfg.max_prefill_tokens, cfg.decode_window,
                                   cfg.max_model_len, min_admit=max(1, cfg.max_num_seqs // 16))

    def release(self) -> None:
        """Free the KV cache and graphs (nothing may be running)."""
        if self.scheduler is not None and self.scheduler.has_work():
            raise RuntimeError("Engine.release: requests are still running")
        self.scheduler = None
        self.runner.release()

    def reset_stats(self) -> EngineStats:
        old, self.stats = self.stats, EngineStats()
        return old

    # ---- requests ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id}: prompt is empty")
        if request.n < 1:
            raise ValueError(f"request {request.request_id}: n must be >= 1, got {request.n}")
        if self.scheduler is None:
            self._start()
        self.scheduler.add(request)

    def has_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_work()

    def abort(self, request_ids: set[int]) -> list[Completion]:
        if self.scheduler is None:
            return []
        return [self._completion(s) for s in self.scheduler.abort(request_ids)]

    def step(self) -> list[Completion]:
        """One plan (a prefill or a decode window); returns the sequences that finished in it."""
        if self.scheduler is None:
            return []
        started, preempted = time.perf_counter(), self.scheduler.num_preemptions
        with torch.inference_mode():
            plan = self.scheduler.schedule()
            done = [] if plan is None else (self._prefill(plan) if plan.prefill else self._decode(plan))
        self.stats.seconds += time.perf_counter() - started
        # a delta, so reset_stats starts the count anew even within one KV session
        self.stats.num_preemptions += self.scheduler.num_preemptions - preempted
        return done

    def generate(self, requests: list[Request]) -> list[list[Completion]]:
        """All requests to completion; out[i] = request i's n completions by sample index."""
        for r in requests:
            self.add(r)
        by_id: dict[int, list[Completion]] = {r.request_id: [] for r in requests}
        while self.has_work():
            for c in self.step():
                by_id[c.request_id].append(c)
        return [sorted(by_id[r.request_id], key=lambda c: c.index) for r in requests]

    # ---- steps ---------------------------------------------------------------------------------
    def _prefill(self, plan: Plan) -> list[Completion]:
        runner, blocks = self.runner, self.scheduler.blocks
        logits = runner.prefill(plan.prefill)
        src, dst = [], []
        for item in plan.prefill:
            seqs = item.sequences
            if len(seqs) > 1:
                tables, copies = blocks.fork(seqs[0].block_table, len(item.token_ids), len(seqs))
                for s, t in zip(seqs, tables):
                    s.block_table = t
                src += [a for a, _ in copies]
                dst += [b for _, b in copies]
        runner.cache.copy_pages(src, dst)
        out = runner.sample_first(logits, plan.prefill)
        seqs = [s for item in plan.prefill for s in item.sequences]
        self.scheduler.start(seqs)
        self.stats.num_prefill_steps += 1
        self.stats.num_prefill_tokens += sum(len(item.token_ids) for item in plan.prefill)
        return self._absorb(seqs, out)

    def _decode(self, plan: Plan) -> list[Completion]:
        blocks = self.scheduler.blocks
        self.stats.kv_used_sum += blocks.num_used / max(blocks.num_blocks - 1, 1)
        self.stats.num_windows += 1
        out = self.runner.decode(plan.decode, plan.window)
        self.stats.num_decode_steps += plan.window
        self.stats.num_decode_rows += plan.window * len(plan.decode)
        self.stats.num_grouped_rows += plan.window * out.num_grouped_rows
        return self._absorb(plan.decode, out)

    def _absorb(self, seqs: list[Sequence], out: StepOutput) -> list[Completion]:
        """Append each row's new tokens up to its first stop; finish the rows that stopped."""
        done = []
        for seq, toks, lps in zip(seqs, out.tokens, out.log_probs):
            p = seq.params
            first_new = seq.num_generated
            keep = min(len(toks), seq.max_new_tokens - first_new)
            reason = "length" if keep == seq.max_new_tokens - first_new else None
            stop_ids = self._stop_ids(p)
            if stop_ids and not stop_ids.isdisjoint(toks[:keep]):
                keep = next(j for j, t in enumerate(toks) if t in stop_ids) + 1
                reason = "stop"
            seq.token_ids.extend(toks[:keep])
            seq.log_probs.extend(lps[:keep])
            self.stats.num_generated_tokens += keep
            if p.stop:
                hit = StopStrings(self.tokenizer, p.stop).first_hit(seq.response_ids, first_new)
                if hit is not None:
                    cut = seq.num_prompt_tokens + hit + 1
                    self.stats.num_generated_tokens -= len(seq.token_ids) - cut
                    del seq.token_ids[cut:]
                    del seq.log_probs[hit + 1:]
                    seq.stopped_by_string = True
                    reason = "stop"
            if reason is not None:
                self.scheduler.finish(seq, reason)
                done.append(self._completion(seq))
        return done

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        key = id(params)
        hit = self._stop_id_cache.get(key)
        if hit is None or hit[0] is not params:
            ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
            hit = self._stop_id_cache[key] = (params, ids)
        return hit[1]

    def _completion(self, seq: Sequence) -> Completion:
        text = self.tokenizer.decode(seq.response_ids, skip_special_tokens=False)
        if seq.stopped_by_string:
            text = cut_after_stop(text, seq.params.stop)
        return Completion(request_id=seq.request.request_id, index=seq.index, token_ids=seq.response_ids,
                          log_probs=list(seq.log_probs), text=text, finish_reason=seq.finish_reason or "abort")
